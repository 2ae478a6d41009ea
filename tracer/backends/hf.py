"""HF transformers backend: record the experts each token was actually routed to.

How. transformers >= 5 MoE blocks call a router module that returns the routing decision, and pass
its indices to the experts module (``DeepseekV3TopkRouter``, ``Qwen3MoeTopKRouter``,
``MixtralTopKRouter``, ``OlmoeTopKRouter``, ``GptOssTopKRouter`` return ``(router_logits,
topk_weights, topk_indices)``; ``Llama4Router`` returns ``(router_scores, router_logits)`` with
``router_scores`` zero outside the chosen experts). A forward hook on each MoE layer's router keeps
those indices: the decision the model made, including DeepSeek-V3's group-limited, bias-corrected
selection; nothing is recomputed from logits.

Generation uses ``model.generate`` with a KV cache and left padding. Forward 0 of a batch is the
prefill (every prompt token), forward j >= 1 feeds generated token j-1. So prompt positions are
``prefill``, generated positions are ``decode``, and the last generated token, never fed back, has
no routing: its row holds -1. Padding (left pads, and the pads fed after a request finished while
others continue) is never recorded.

Shape legend: R requests in the generation batch, T token positions (the padded positions of the
batch, or the tokens of one request), N router rows of one forward (R*T in the prefill, R per
decode step), L MoE layers, K top-k, X = L*K (legend: docs/architecture.md).

The backend itself is :class:`HfBackend` (the ``backends.base.CollectionBackend`` protocol); its
manifest ``backend`` section is ``{"name": "hf", "versions": {"transformers", "torch"}, "device"}``.

Out of scope: what a model name means (``presets.resolve``), prompt loading (``datasets``), opening
the trace, resume and progress bars (``collect``), vLLM (``vllm``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moetrace._deps import require
from moetrace.errors import ModelError
from moetrace.tracer.backends.base import BackendDescription, GenerationConfig, OnProgress
from moetrace.tracer.trace.schema import NO_EXPERT, ModelInfo

if TYPE_CHECKING:  # pragma: no cover
    from moetrace.tracer.datasets import PromptRecord
    from moetrace.tracer.presets import ResolvedModel, TinyEngine
    from moetrace.tracer.trace.writer import TraceWriter

#: largest model (parameters) `collect` agrees to run on a CPU
MAX_CPU_PARAMS = 3_000_000_000

#: MLP attribute names of decoder layers, and router attribute names of MoE blocks
_MLP_ATTRS = ("mlp", "feed_forward", "block_sparse_moe")
_ROUTER_ATTRS = ("gate", "router")


# ---------------------------------------------------------------------------------------- models
def tiny_tokenizer():
    """The byte-level tokenizer of the ``-tiny`` models: 256 byte tokens + ``<pad> <bos> <eos>``.

    Built in code (nothing downloaded); ids 0..255 are bytes, then pad, bos, eos
    (``presets.TINY_PAD_ID``, ``TINY_BOS_ID``, ``TINY_EOS_ID``: 256, 257, 258).
    """
    tokenizers = require("tokenizers", purpose="the tiny models' tokenizer")
    transformers = require("transformers", purpose="the HF transformers backend")
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for name in ("<pad>", "<bos>", "<eos>"):
        vocab[name] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
    fast.padding_side = "left"
    return fast


def save_tiny_tokenizer(directory: str | os.PathLike) -> None:
    """Save :func:`tiny_tokenizer` to ``directory`` so that transformers 4 and 5 both load it with ``AutoTokenizer``.

    transformers 5 names the class ``TokenizersBackend`` in ``tokenizer_config.json``, which
    transformers 4 (what vLLM runs on) does not know; the file names ``PreTrainedTokenizerFast``,
    which both load from ``tokenizer.json``, and left padding.
    """
    tiny_tokenizer().save_pretrained(directory)
    path = Path(directory) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", padding_side="left")
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def build_tiny_model(
    preset_name: str, *, seed: int, device: str = "cpu", dtype: str = "float32", engine: TinyEngine = "hf"
):
    """Build a ``-tiny`` preset: real architecture class, real routing topology, seeded random weights.

    Returns ``(model, model_info)``. ``engine="hf"``: the ``-tiny`` dims (toy sizes, fast on a CPU).
    ``engine="vllm"``: the preset's vLLM-sized tiny config (``Preset.tiny_overrides``: real head
    dims, small widths), what ``make-checkpoint`` saves; ``model_info`` then carries its hidden size.
    DeepSeek-V3's router bias (``e_score_correction_bias``) is drawn at random too, so that the
    bias-corrected, group-limited selection differs from a plain top-k of the scores, as in the
    released model.
    """
    from moetrace.tracer.presets import TINY_BOS_ID, TINY_EOS_ID, TINY_PAD_ID, resolve

    resolved = resolve(preset_name)
    if resolved.kind != "tiny-preset":
        raise ModelError(f"{preset_name!r} is not a -tiny preset (see `moetrace models`)")
    preset = resolved.preset
    assert preset is not None  # set for every preset name
    torch = require("torch", purpose="the HF transformers backend")
    transformers = require("transformers", purpose="the HF transformers backend")
    cfg = preset.hf_config(tiny=True, engine=engine)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    for _, router in _iter_routers(model):
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            with torch.no_grad():
                bias.copy_(0.02 * torch.randn(bias.shape, generator=gen))
    model.generation_config.pad_token_id = TINY_PAD_ID
    model.generation_config.eos_token_id = TINY_EOS_ID
    model.generation_config.bos_token_id = TINY_BOS_ID
    return model.to(device).eval(), preset.model_info(tiny=True, engine=engine)


def load_model(
    resolved: ResolvedModel, *, seed: int, device: str = "cpu", dtype: str = "auto"
) -> tuple[Any, Any, ModelInfo]:
    """Return ``(model, tokenizer, model_info)`` for a resolved model name (``presets.resolve``).

    A ``-tiny`` preset is built in memory. A preset, local checkpoint or hub id is loaded with
    transformers' loaders (a preset from its hub id). A full-size model is refused on a CPU with a
    message that names the ``-tiny`` preset. A ``-tiny`` model on a CPU runs torch with one
    intra-op thread: its matrices are too small to gain from more, and OpenMP workers spinning on a
    busy machine made generation 20-30x slower.
    """
    from moetrace.tracer.presets import TINY_SUFFIX

    name = resolved.name
    torch = require("torch", purpose="the HF transformers backend")
    transformers = require("transformers", purpose="the HF transformers backend")
    on_cpu = str(device).startswith("cpu")
    if resolved.kind == "tiny-preset":
        if on_cpu:
            torch.set_num_threads(1)
        model, info = build_tiny_model(name, seed=seed, device=device, dtype="float32" if dtype == "auto" else dtype)
        return model, tiny_tokenizer(), info
    cfg = resolved.hf_config()
    info = resolved.model_info(hf_config=cfg)
    if on_cpu:
        n = count_parameters(cfg)
        if n > MAX_CPU_PARAMS:
            tiny = f"{name}{TINY_SUFFIX}" if resolved.kind == "preset" else "a -tiny preset (see `moetrace models`)"
            raise ModelError(
                f"{name} has {n / 1e9:.0f}B parameters: too large to run on a CPU. Use the same routing topology "
                f"at CPU size with --model {tiny}, or collect on GPUs (--backend vllm, or --device cuda)."
            )
    with _progress_bars_as_environment(transformers):
        model = transformers.AutoModelForCausalLM.from_pretrained(resolved.source, dtype=dtype).to(device)
        tok = transformers.AutoTokenizer.from_pretrained(resolved.source)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok, info


# -------------------------------------------------------------------------------------- routers
@contextlib.contextmanager
def _progress_bars_as_environment(transformers: Any) -> Iterator[None]:
    """transformers' tqdm bars (weights loading) off for the block when ``HF_HUB_DISABLE_PROGRESS_BARS``
    is set (``collect -q``, or stderr not a terminal), however early huggingface_hub read that variable;
    its switch restored after."""
    log = transformers.utils.logging
    asked = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").upper() in {"1", "ON", "YES", "TRUE"}
    turn_off = asked and log.is_progress_bar_enabled()
    if turn_off:
        log.disable_progress_bar()
    try:
        yield
    finally:
        if turn_off:
            log.enable_progress_bar()


def count_parameters(cfg) -> int:
    """Parameters of the model a config describes (built on the meta device: no memory, no download)."""
    torch = require("torch", purpose="the HF transformers backend")
    transformers = require("transformers", purpose="the HF transformers backend")
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in meta.parameters())


def _decoder_layers(model) -> Sequence[Any]:
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ModelError(f"{type(model).__name__}: cannot find the decoder layers (model.model.layers)")
    return layers


def _iter_routers(model):
    """Yield ``(layer_index, router_module)`` for every decoder layer with a routed-expert block."""
    for i, layer in enumerate(_decoder_layers(model)):
        for mattr in _MLP_ATTRS:
            block = getattr(layer, mattr, None)
            if block is None or not hasattr(block, "experts"):
                continue
            for rattr in _ROUTER_ATTRS:
                router = getattr(block, rattr, None)
                if router is not None:
                    yield i, router
                    break
            break


@dataclass
class RoutingRecorder:
    """Forward hooks on every MoE router of ``model``; one entry per forward pass and MoE layer.

    Use as a context manager around ``model.generate``; ``steps`` then holds, per forward pass, a
    list over MoE layers of ``topk_ids_NK`` (int64 tensors on the model's device) and, with
    ``record_weights``, ``topk_weights_NK``.
    """

    model: Any
    info: ModelInfo
    record_weights: bool = False
    ids: list[list[Any]] = field(default_factory=list)  # [layer][forward] -> topk_ids_NK
    weights: list[list[Any]] = field(default_factory=list)  # [layer][forward] -> topk_weights_NK

    def __post_init__(self) -> None:
        self._handles: list[Any] = []
        routers = list(_iter_routers(self.model))
        found = tuple(i for i, _ in routers)
        if found != self.info.moe_layers:
            raise ModelError(
                f"{self.info.name}: routers found at layers {list(found)[:6]}... ({len(found)}), but the config "
                f"says MoE layers {list(self.info.moe_layers)[:6]}... ({self.info.num_moe_layers})"
            )
        self._routers = [r for _, r in routers]
        self.ids = [[] for _ in routers]
        self.weights = [[] for _ in routers]

    def _hook(self, slot: int):
        K = self.info.top_k

        def hook(module, args, output):
            if len(output) == 3:  # (router_logits, topk_weights, topk_indices)
                ids, w = output[2], output[1]
            elif len(output) == 2:  # Llama-4: (router_scores [N, E] zero outside the choice, router_logits)
                scores = output[0]
                w, ids = scores.topk(K, dim=-1)
            else:
                raise ModelError(f"{type(module).__name__} returned {len(output)} values; cannot read its routing")
            self.ids[slot].append(ids.detach())
            if self.record_weights:
                w = w.detach()
                if w.shape[-1] != K:  # some routers return dense [N, E] scores
                    w = w.gather(-1, ids)
                self.weights[slot].append(w.float())

        return hook

    def __enter__(self) -> RoutingRecorder:
        for slot, router in enumerate(self._routers):
            self._handles.append(router.register_forward_hook(self._hook(slot)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def num_forwards(self) -> int:
        return len(self.ids[0]) if self.ids else 0


# ----------------------------------------------------------------------------------- generation
@dataclass(frozen=True)
class GeneratedRequest:
    """One finished request: its routing rows (positions 0..T-1) and token counts."""

    prompt_tokens: int
    output_tokens: int
    topk_ids_TX: np.ndarray  # int16 [T, L*K], -1 where nothing was recorded
    topk_weights_TX: np.ndarray | None  # float32 [T, L*K] or None
    output_ids: list[int]


def generate_batch(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    *,
    info: ModelInfo,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    record_weights: bool = False,
) -> list[GeneratedRequest]:
    """Generate for a batch of tokenized prompts and return each request's routing rows.

    Greedy when ``temperature == 0`` (default); otherwise sampling seeded with ``seed``.
    Attribution is exact: row ``p`` of request ``r`` is the routing of the forward pass that fed
    the token at position ``p`` of ``r``.
    """
    torch = require("torch", purpose="the HF transformers backend")
    R = len(prompt_ids)
    lens = [len(p) for p in prompt_ids]
    if min(lens) < 1:
        raise ValueError("empty prompt")
    T = max(lens)  # padded positions of the prefill
    pad = tokenizer.pad_token_id
    device = next(model.parameters()).device
    input_ids_RT = torch.full((R, T), pad, dtype=torch.long)
    attn_RT = torch.zeros((R, T), dtype=torch.long)
    for r, p in enumerate(prompt_ids):  # left padding
        input_ids_RT[r, T - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn_RT[r, T - len(p) :] = 1
    gen_kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=1,
        pad_token_id=pad,
        eos_token_id=model.generation_config.eos_token_id,
        use_cache=True,
        return_dict_in_generate=False,
    )
    if temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        torch.manual_seed(seed)
    else:
        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)

    rec = RoutingRecorder(model, info, record_weights=record_weights)
    with rec, torch.inference_mode():
        seqs = model.generate(input_ids=input_ids_RT.to(device), attention_mask=attn_RT.to(device), **gen_kwargs)
    new = seqs[:, T:].cpu()
    n_forwards = rec.num_forwards
    if n_forwards != new.shape[1]:
        raise RuntimeError(f"recorded {n_forwards} forward passes for {new.shape[1]} generated tokens")
    eos = model.generation_config.eos_token_id
    eos_set = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()

    ids = _per_request_rows(rec.ids, R=R, T=T, K=info.top_k, dtype=torch.int16)
    weights = _per_request_rows(rec.weights, R=R, T=T, K=info.top_k, dtype=torch.float32) if record_weights else None
    out = []
    for r in range(R):
        toks = new[r].tolist()
        O = next((j + 1 for j, t in enumerate(toks) if t in eos_set), len(toks))
        P = lens[r]
        ex = ids(r, prompt_len=P, num_out=O, fill=NO_EXPERT)
        w = weights(r, prompt_len=P, num_out=O, fill=0.0) if weights is not None else None
        out.append(GeneratedRequest(P, O, ex, w, toks[:O]))
    return out


def _per_request_rows(per_layer: list[list[Any]], *, R: int, T: int, K: int, dtype) -> Callable[..., np.ndarray]:
    """Stack the recorded forwards once and return ``rows(r, prompt_len, num_out, fill) -> [P+O, L*K]``.

    ``per_layer[l][0]`` is the prefill ``[R*T, K]`` (T padded positions, left-padded),
    ``per_layer[l][j]`` for j >= 1 the decode step that fed generated token j-1 ``[R, K]``. Request
    r's prompt is the last ``prompt_len`` positions of the prefill; its generated token j <
    num_out-1 is step j of the decode stack; its last generated token, never fed, gets ``fill``.
    """
    torch = require("torch", purpose="the HF transformers backend")
    L = len(per_layer)
    pre_LRTK = torch.stack([x[0].reshape(R, T, K) for x in per_layer]).to("cpu", dtype).numpy()
    dec_LRTK = (  # T here: the decode steps
        torch.stack([torch.stack([y.reshape(R, K) for y in x[1:]], dim=1) for x in per_layer]).to("cpu", dtype).numpy()
        if len(per_layer[0]) > 1
        else None
    )

    def rows(r: int, *, prompt_len: int, num_out: int, fill: float) -> np.ndarray:
        P, O = prompt_len, num_out
        out_TLK = np.full((P + O, L, K), fill, dtype=pre_LRTK.dtype)
        out_TLK[:P] = pre_LRTK[:, r, T - P :, :].transpose(1, 0, 2)
        if O > 1:
            assert dec_LRTK is not None  # two generated tokens or more: decode steps were recorded
            out_TLK[P : P + O - 1] = dec_LRTK[:, r, : O - 1, :].transpose(1, 0, 2)
        return out_TLK.reshape(P + O, L * K)

    return rows


@dataclass
class HfBackend:
    """The HF transformers backend behind the collection seam (``backends.base.CollectionBackend``).

    One object per run, built by its row in ``backends.registry``; ``collect`` calls
    :meth:`check_environment`, :meth:`load`, :meth:`describe` and :meth:`run` in that order.
    """

    device: str = "cpu"  # torch device the model runs on
    dtype: str = "auto"  # torch dtype of the weights (tiny models: float32)
    _versions: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _loaded: tuple[Any, Any, ModelInfo] | None = field(default=None, init=False, repr=False)  # model, tokenizer, info

    def check_environment(self, generation: GenerationConfig) -> None:
        """torch and transformers importable (else ``MissingDependencyError`` naming the extra), and a
        ``cuda`` device visible when one is asked for (counted without initialising CUDA)."""
        torch = require("torch", purpose="the HF transformers backend")
        transformers = require("transformers", purpose="the HF transformers backend")
        if str(self.device).startswith("cuda") and torch.cuda.device_count() == 0:
            raise ModelError(f"--device {self.device}: no CUDA GPU is visible here; use --device cpu")
        self._versions = {"transformers": transformers.__version__, "torch": torch.__version__}

    def load(self, resolved: ResolvedModel, generation: GenerationConfig) -> ModelInfo:
        """Load the model and tokenizer (:func:`load_model`, seeded by ``generation.seed``)."""
        self._loaded = load_model(resolved, seed=generation.seed, device=self.device, dtype=self.dtype)
        return self._loaded[2]

    def describe(self) -> BackendDescription:
        return BackendDescription(versions=self._versions, settings={"device": self.device})

    def run(
        self,
        prompts: Sequence[PromptRecord],
        *,
        writer: TraceWriter,
        generation: GenerationConfig,
        on_progress: OnProgress | None = None,
    ) -> None:
        """Run every prompt not yet in ``writer.completed_request_ids`` and write its rows; commit per batch.

        Prompts are sorted by token length so batches pad little; each batch of
        ``generation.batch_size`` is one commit, so a kill loses at most the batch in flight. Batch
        ``b`` samples with seed ``generation.seed + b * batch_size``. ``on_progress(requests,
        tokens)`` gets, after each commit, what this run has written so far (cumulative counts).
        """
        from moetrace.tracer.datasets import render_prompt_ids

        if self._loaded is None:
            raise RuntimeError("HfBackend.run before load")
        model, tokenizer, info = self._loaded
        g = generation
        pending = [p for p in prompts if p.request_id not in writer.completed_request_ids]
        encoded = [(p, render_prompt_ids(p, tokenizer, chat_template=g.chat_template)) for p in pending]
        encoded.sort(key=lambda pe: (len(pe[1]), pe[0].request_id))
        for start in range(0, len(encoded), g.batch_size):
            chunk = encoded[start : start + g.batch_size]
            results = generate_batch(
                model,
                tokenizer,
                [ids for _, ids in chunk],
                info=info,
                max_new_tokens=g.max_new_tokens,
                temperature=g.temperature,
                seed=g.seed + start,
                record_weights=g.record_weights,
            )
            for (p, _), r in zip(chunk, results):
                writer.add_request(
                    request_id=p.request_id,
                    dataset=p.dataset,
                    prompt_tokens=r.prompt_tokens,
                    topk_ids_TX=r.topk_ids_TX,
                    topk_weights_TX=r.topk_weights_TX,
                    prompt_text=p.text if g.store_text else None,
                    output_text=tokenizer.decode(r.output_ids, skip_special_tokens=True) if g.store_text else None,
                )
            writer.commit()
            if on_progress is not None:
                on_progress(writer.num_requests_written, writer.num_tokens_written)
