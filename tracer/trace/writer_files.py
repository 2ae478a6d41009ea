"""The trace writer's files on disk: creating, hashing and syncing part files, resuming, replacing a trace.

What it holds: the exclusive, never-through-a-link creation of a part's temporary files, hashed as written
(``_create_hashed``), a committed part's manifest entry read back from disk (``_part_entry``), ``fsync`` of a
file or directory, the one-line description of a failed write, the checks a trace must pass to be resumed
(``check_resumable``), and ``replacing_trace`` (a new trace written beside the old one and swapped in whole).

Out of scope: the rows and the commit protocol (``writer``), file names (``layout``), the locks (``lock``),
the checksums themselves (``checksum``), the atomic directory swap (``moetrace.atomic``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moetrace.errors import OutputExistsError, TraceFormatError, option_hint
from moetrace.tracer.trace.checksum import HashingFile, file_sha256
from moetrace.tracer.trace.lock import lock_trace
from moetrace.tracer.trace.schema import ModelInfo, check_manifest_header


def check_resumable(
    path: Path,
    manifest_path: Path,
    *,
    model: ModelInfo,
    with_weights: bool,
    with_text: bool,
    collection: dict[str, Any],
) -> dict[str, Any]:
    """The manifest of the trace at ``path`` that a writer resumes, refused (``OutputExistsError``) when it is
    missing or damaged, of another model, written with other ``with_weights`` / ``with_text``, or collected with
    other settings that decide which prompt a request id is."""
    if not manifest_path.exists():
        raise OutputExistsError(
            f"{path} has no {manifest_path.name} (a damaged trace, or an --overwrite that was "
            "interrupted); use --overwrite to start afresh"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict):
            raise TraceFormatError(f"{manifest_path}: expected a JSON object")
        check_manifest_header(manifest, where=str(manifest_path))
    except (TraceFormatError, ValueError, RecursionError) as exc:
        raise OutputExistsError(f"{str(exc)[:300]}. Use --overwrite to replace it.") from None
    old = manifest.get("model", {})
    new = model.to_dict()
    model_keys = ("source", "architecture", "moe_layers", "num_experts", "top_k")
    diff = [f"{k}: {old.get(k)!r} (on disk) vs {new.get(k)!r} (now)" for k in model_keys if old.get(k) != new.get(k)]
    if diff:
        raise OutputExistsError(
            f"{path} holds a trace of a different model ({'; '.join(diff)}). "
            "Use another -o, or --overwrite to replace it."
        )
    old_w = manifest.get("writer", {})
    for key, mine in (("with_weights", with_weights), ("with_text", with_text)):
        if key in old_w and bool(old_w[key]) != mine:
            raise OutputExistsError(
                f"{path} was written with {key}={old_w[key]}, this run has {key}={mine}; "
                "use the same options to resume, or --overwrite"
            )
    # everything that decides which prompt a request id is (or how it is rendered and sampled):
    # resuming with another value would skip or repeat requests under the wrong ids
    keys = (
        "datasets",
        "per_dataset",
        "num_requests",
        "prompt_field",
        "chat_template",
        "seed",
        "max_new_tokens",
        "sampling",
        "num_shards",
    )
    for key in keys:
        if (
            key in manifest.get("collection", {})
            and key in collection
            and manifest["collection"][key] != collection[key]
        ):
            raise OutputExistsError(
                f"{path} was collected with {key}={manifest['collection'][key]!r}, this run asks for "
                f"{key}={collection[key]!r}; resume with the same settings, or --overwrite"
            )
    return manifest


@contextlib.contextmanager
def replacing_trace(path: str | os.PathLike, *, overwrite: bool) -> Iterator[Path]:
    """Where to write a trace that replaces the one at ``path`` only once it is whole.

    Without ``overwrite``, or when ``path`` holds no trace, yields ``path`` itself. Otherwise takes
    ``path``'s writer lock (refused while another writer holds it), yields a fresh hidden directory
    beside it to write the new trace into and, when the block succeeds, swaps it in whole
    (``moetrace.atomic.replacing_directory``: one atomic exchange on Linux, so ``path`` is never
    missing); when the block fails, the new directory is removed and the old trace is untouched. For
    producers that cannot resume (``import``).
    """
    from moetrace.atomic import recover_directory, replacing_directory
    from moetrace.tracer.trace.layout import is_trace_directory

    p = Path(path)
    recover_directory(p)  # a two-rename swap killed half-way: the old trace goes back first
    if not overwrite or not p.is_dir() or not is_trace_directory(p):
        yield p
        return
    lock = lock_trace(p)
    try:
        with replacing_directory(p) as new:
            yield new
    finally:
        lock.release()


def _describe_write_error(exc: BaseException, path: Path) -> str:
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC or "No space left on device" in str(exc):
        cause = "no space left on device"
    elif code == errno.EDQUOT:
        cause = "disk quota exceeded"
    else:
        cause = str(exc).splitlines()[0]
    return (
        f"cannot write the trace {path}: {cause}. The requests committed so far are kept; free space, then run "
        f"the same command again{_WITH_RESUME}"
    )


#: dropped from the message of a writer without --resume (import, synth: ``moetrace.errors.option_hint``)
_WITH_RESUME = option_hint("--resume", " (with --resume)")


def _create_hashed(path: Path, *, sync_every: int | None = None) -> HashingFile:
    """Create ``path`` exclusively, never through a link (module docstring), open for writing and hashed
    (``sync_every``: see ``HashingFile``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        f = os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise
    return HashingFile(f, sync_every=sync_every)


def _part_entry(num_requests: int, num_tokens: int, routing: Path, requests: Path) -> dict[str, Any]:
    """A part's entry in the manifest's ``parts``: its requests, tokens and both files' SHA-256."""
    return {
        "num_requests": int(num_requests),
        "num_tokens": int(num_tokens),
        "routing_sha256": file_sha256(routing),
        "requests_sha256": file_sha256(requests),
    }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
