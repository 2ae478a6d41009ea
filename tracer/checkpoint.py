"""``make-checkpoint``: write a tiny checkpoint directory of a preset that the HF and vLLM backends both run.

The directory is a self-contained HF checkpoint, laid out like a released model's:

- ``config.json``: the preset's vLLM-sized tiny config (``Preset.tiny_overrides(engine="vllm")``,
  from ``data/models/<preset>.json``): the released model's architecture class and routing topology
  (layers, MoE-layer pattern, experts, top-k, router groups, shared experts) and its attention head
  dims (``head_dim``; DeepSeek-V3's MLA ranks and head dims), with a small hidden size, two
  attention heads and small FFN widths. The toy head dims of the ``-tiny`` presets have no vLLM
  attention kernel; these do. Written by transformers 5 and completed with the names transformers 4
  reads (vLLM runs on transformers 4): every field of the preset under its released name
  (e.g. Qwen3-MoE's ``num_experts``), ``rope_theta`` and, for a scaled RoPE, ``rope_scaling``;
- ``model.safetensors`` and ``generation_config.json``: the seeded random weights of
  ``backends.hf.build_tiny_model(..., engine="vllm")`` (built in float32, stored in ``dtype``),
  saved in the released checkpoints' tensor names (per-expert tensors where the hub has them);
- ``tokenizer.json``, ``tokenizer_config.json``: the tiny byte-level tokenizer
  (``backends.hf.save_tiny_tokenizer``), loadable by ``AutoTokenizer`` under transformers 4 and 5;
- ``moetrace-checkpoint.json``: provenance (preset, seed, dtype, dims, parameter count, moetrace version).

The directory is built beside ``out`` and renamed into place when complete, so ``out`` never holds
half a checkpoint; a write that fails (a full disk) removes the partial copy and says so in one line.

Out of scope: what a model name means (``presets.resolve``: the written directory is then a "local"
name), running it (``backends.hf``, ``backends.vllm``), downloading anything, quantized weights,
multi-file (sharded) checkpoints, and the ``-tiny`` presets' toy dims (built in memory, never saved here).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrace import __version__
from moetrace._deps import require
from moetrace.errors import ModelError, OutputExistsError, WriteError
from moetrace.tracer.presets import TINY_SUFFIX, Preset, list_presets, resolve

#: the provenance file of a checkpoint directory
PROVENANCE_FILE = "moetrace-checkpoint.json"
#: its format name and version
PROVENANCE_FORMAT, PROVENANCE_VERSION = "moetrace-checkpoint", 1
#: weight dtypes a checkpoint can be written in (torch dtype names)
DTYPES = ("bfloat16", "float16", "float32")
#: HF architecture classes vLLM serves, as named in its model registry
#: (vllm/model_executor/models/registry.py, ``_TEXT_GENERATION_MODELS``; checked for every preset)
VLLM_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Qwen3MoeForCausalLM",
)


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What :func:`make_checkpoint` wrote."""

    path: Path  # the checkpoint directory (a "local" model name for `collect --model`)
    preset: str  # the preset it was made from, e.g. "deepseek-v3"
    architecture: str  # HF class name, e.g. "DeepseekV3ForCausalLM"
    num_parameters: int  # parameters of the model (weights; buffers not counted)
    bytes_on_disk: int  # bytes of every file in the directory


def make_checkpoint(
    preset: str,
    *,
    out: str | os.PathLike,
    seed: int = 0,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    progress: bool = True,
) -> CheckpointInfo:
    """Write the vLLM-sized tiny checkpoint of ``preset`` (a preset name, e.g. ``deepseek-v3``) to ``out``.

    ``seed`` fixes the weights (the same seed writes the same tensors); ``dtype`` is the weight
    dtype on disk (``bfloat16``, ``float16`` or ``float32``). Refuses, with one line and before
    building anything: a name that is not a preset (a ``-tiny`` name included), a preset whose
    architecture vLLM does not serve or that has no vLLM-sized config (``ModelError``), an unknown
    dtype (``ModelError``), and an ``out`` that is a file, or a non-empty directory without
    ``overwrite`` (``OutputExistsError``). With ``overwrite`` the old directory is replaced only
    once the new one is complete. A write that fails (disk full, quota, I/O error) raises ``WriteError``
    naming the cause, with the partial copy removed and an old checkpoint kept. ``progress`` False: no progress bar from transformers while the
    weights are written.
    """
    p = _vllm_preset(preset)
    if dtype not in DTYPES:
        raise ModelError(f"unknown weight dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    out = Path(out).expanduser()
    _check_out(out, overwrite=overwrite)
    torch = require("torch", purpose="building a checkpoint")
    require("transformers", purpose="building a checkpoint")
    require("safetensors", purpose="writing a checkpoint's weights")
    from moetrace.tracer.backends.hf import build_tiny_model, save_tiny_tokenizer

    had = out.is_dir() and any(out.iterdir())  # an old checkpoint --overwrite replaces (kept if this one fails)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as exc:
        raise WriteError(_write_failure(exc, out, kept=had, partial=False)) from exc
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; a checkpoint is shared like any directory
        model, _ = build_tiny_model(p.name + TINY_SUFFIX, seed=seed, dtype="float32", engine="vllm")
        num_parameters = sum(t.numel() for t in model.parameters())
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        if not progress:
            hf_logging.disable_progress_bar()
        try:
            model.to(getattr(torch, dtype)).save_pretrained(tmp, save_original_format=True)
        finally:
            if bars and not progress:
                hf_logging.enable_progress_bar()
        _complete_config(tmp / "config.json", p)
        save_tiny_tokenizer(tmp)
        _write_json(tmp / PROVENANCE_FILE, _provenance(p, seed=seed, dtype=dtype, num_parameters=num_parameters))
        _finish_files(tmp)
        _replace_dir(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint never stays, not even under a hidden name
        if _is_write_failure(exc):
            raise WriteError(_write_failure(exc, out, kept=had, partial=True)) from exc
        raise
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return CheckpointInfo(
        path=out, preset=p.name, architecture=p.architecture, num_parameters=num_parameters, bytes_on_disk=size
    )


#: how the Rust writers under transformers report a failed write: safetensors as ``SafetensorError("Error while
#: serializing: I/O error: No space left on device (os error 28)")``, tokenizers as a bare
#: ``Exception("No space left on device (os error 28)")``
_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)")


def _errno(exc: BaseException) -> int | None:
    """The OS error number of a failed write: an ``OSError``'s, or the one a Rust writer's message names."""
    if isinstance(exc, OSError):
        return exc.errno
    m = _RUST_IO_ERROR.search(str(exc))
    return int(m.group(1)) if m else None


def _is_write_failure(exc: BaseException) -> bool:
    """``exc`` is a write that failed (an ``OSError``, or a Rust writer's error naming the OS error), not one of
    moetrace's own errors or an interruption."""
    if isinstance(exc, WriteError) or not isinstance(exc, Exception):
        return False
    return isinstance(exc, OSError) or _errno(exc) is not None


def _write_failure(exc: BaseException, out: Path, *, kept: bool, partial: bool) -> str:
    """The one line for a checkpoint that could not be written (disk full, quota, I/O error): the cause, that
    nothing is at ``out`` (or that the old checkpoint there is kept) and what to do."""
    code = _errno(exc)
    cause = os.strerror(code) if code else (str(exc).splitlines() or [type(exc).__name__])[0]
    where = "the checkpoint there before is kept as it was" if kept else f"nothing was written at {out}"
    removed = " (the partial copy beside it was removed)" if partial else ""
    fix = "free space, then run the same command again" if code in (errno.ENOSPC, errno.EDQUOT) else "run it again"
    return f"cannot write the checkpoint {out}: {cause[:1].lower()}{cause[1:]}; {where}{removed}: {fix}"


def _vllm_preset(name: str) -> Preset:
    """The preset called ``name``, if vLLM serves its architecture and it has a vLLM-sized config."""
    resolved = resolve(name)  # an unknown name: ModelError naming the presets
    p = resolved.preset
    if resolved.kind == "tiny-preset":
        assert p is not None  # set for every preset name
        raise ModelError(
            f"{name}: pass the preset name ({p.name}); make-checkpoint writes its "
            "vLLM-sized tiny variant (real head dims), not the -tiny dims"
        )
    if resolved.kind != "preset":
        names = ", ".join(p.name for p in list_presets())
        raise ModelError(f"{name!r} is not a model preset; make-checkpoint takes one of: {names}")
    assert p is not None  # set for every preset name
    if p.architecture not in VLLM_ARCHITECTURES:
        raise ModelError(
            f"{p.name}: vLLM does not serve {p.architecture}; make-checkpoint supports {', '.join(VLLM_ARCHITECTURES)}"
        )
    p.tiny_overrides(engine="vllm")  # ModelError when the preset has no vLLM-sized config
    return p


def _check_out(out: Path, *, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory; choose another -o")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out} is not empty; pass --overwrite to replace it, or choose another -o")


def _complete_config(path: Path, p: Preset) -> None:
    """Add to the config.json transformers 5 wrote the names transformers 4 (vLLM) reads.

    Every field of the preset's vLLM-sized config under its released name (transformers 5 renames
    some, e.g. Qwen3-MoE's ``num_experts`` -> ``num_local_experts``), and the legacy RoPE fields:
    ``rope_theta``, and ``rope_scaling`` when the RoPE is scaled (GPT-OSS's YaRN), from
    ``rope_parameters``. transformers 5 reads both spellings to the same values.
    """
    cfg = json.loads(path.read_text())
    cfg.update(p.hf_config_dict(tiny=True, engine="vllm"))
    rope = dict(cfg.get("rope_parameters") or {})
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    _write_json(path, cfg)


def _provenance(p: Preset, *, seed: int, dtype: str, num_parameters: int) -> dict[str, Any]:
    info = p.model_info(tiny=True, engine="vllm")
    return {
        "format": PROVENANCE_FORMAT,
        "version": PROVENANCE_VERSION,
        "preset": p.name,
        "hub_id": p.hub_id,  # the released model whose architecture and routing topology this copies
        "architecture": p.architecture,
        "seed": seed,
        "dtype": dtype,
        "num_parameters": num_parameters,
        "dims": dict(p.tiny_overrides(engine="vllm")),  # what differs from the released config
        "topology": {
            "num_hidden_layers": info.num_hidden_layers,
            "num_moe_layers": info.num_moe_layers,
            "num_experts": info.num_experts,
            "top_k": info.top_k,
            "num_shared_experts": info.num_shared_experts,
            "n_group": info.n_group,
            "topk_group": info.topk_group,
        },
        "moetrace_version": __version__,
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _finish_files(directory: Path) -> None:
    """Give every file of ``directory`` the permissions of a new file (the safetensors writer makes its
    file private), then flush the files and the directory itself to disk."""
    mode = 0o666 & ~_umask()
    for f in directory.iterdir():
        os.chmod(f, mode)
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(new: Path, out: Path) -> None:
    """Rename the complete directory ``new`` to ``out``; an old ``out`` is moved aside first, then removed."""
    if not out.exists():
        os.rename(new, out)
        return
    aside_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    aside = aside_dir / out.name
    os.rename(out, aside)  # out is missing only from here until the next rename
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(aside, out)  # put the old one back
        os.rmdir(aside_dir)
        raise
    shutil.rmtree(aside_dir)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
