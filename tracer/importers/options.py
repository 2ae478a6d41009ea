"""What a user may say about an input beyond its format (``ImportOptions``), and the import's memory budget.

``ImportOptions`` carries the import options that only some formats honour: the physical-to-logical
map of a capture with physical expert ids (``--physical-map``), the prompt span of a teacher-forced
capture (``--prompt-tokens`` / ``--prompt-fraction``) and the memory an import may allocate
(``--max-memory``). A format names the options it honours (``ImportFormat.options``); the others are
refused before anything is read.

The memory budget: an importer estimates each large allocation (the ``[tokens, L*K]`` ids of a batch
of requests, a tensor's declared shape, a profile's counts) from the numbers the input declares, before
making it, and refuses, with the figure and the knob, one over ``memory_budget_bytes``: ``--max-memory``
when given, else half the memory available now: ``MemAvailable`` (the physical memory where the system
does not say), and no more than the process may still map under its ``RLIMIT_AS``. A tensor's declared
shape counts, not its storage: ``torch.save`` keeps a view, so a 2 KB ``.pt`` can declare
``[10**7, 61, 256]`` over one stored number (``check_declared_shape``).

Out of scope: what a format does with an option (its module), reading the map file (``ids``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from moetrace.errors import TraceFormatError
from moetrace.sizes import human_bytes

#: the option names a format may honour (``ImportFormat.options``), as the CLI spells them
PHYSICAL_MAP = "--physical-map"
PROMPT_SPAN = "--prompt-tokens/--prompt-fraction"


@dataclass(frozen=True)
class ImportOptions:
    """Options of one import that only some formats honour (module docstring)."""

    # SGLang's physical_to_logical_map (JSON, or a moetrace placement file) for a capture of physical slot ids
    physical_map: Path | None = None
    # teacher-forced capture: the first N positions of every request are its prompt (the rest decode)
    prompt_tokens: int | None = None
    # teacher-forced capture: the first round(F * length) positions of every request are its prompt, 0 < F <= 1
    prompt_fraction: float | None = None
    # the most bytes one allocation of the import may take; None: half the machine's available memory
    max_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens is not None and self.prompt_fraction is not None:
            raise TraceFormatError("give --prompt-tokens or --prompt-fraction, not both")
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            raise TraceFormatError(f"--prompt-tokens must be >= 1 (a request's prompt), got {self.prompt_tokens}")
        if self.prompt_fraction is not None and not 0 < self.prompt_fraction <= 1:
            raise TraceFormatError(f"--prompt-fraction must be in (0, 1], got {self.prompt_fraction}")
        if self.max_memory_bytes is not None and self.max_memory_bytes < 1:
            raise TraceFormatError(f"--max-memory must be positive, got {self.max_memory_bytes} bytes")

    def given(self) -> list[str]:
        """The option names set here (``PHYSICAL_MAP``, ``PROMPT_SPAN``), for refusing them on other formats."""
        out = []
        if self.physical_map is not None:
            out.append(PHYSICAL_MAP)
        if self.prompt_tokens is not None or self.prompt_fraction is not None:
            out.append(PROMPT_SPAN)
        return out


def _address_space_left() -> int | None:
    """What the process may still map under its ``RLIMIT_AS`` soft limit (None: no limit): the limit less
    ``VmSize`` (``/proc/self/status``; 0 assumed where the system does not say)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = 0
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii", errors="replace").splitlines():
            fields = line.split()
            if fields[:1] == ["VmSize:"] and len(fields) > 1 and fields[1].isdigit():
                used = int(fields[1]) * 1024
    except OSError:  # not Linux: the whole limit
        used = 0
    return max(soft - used, 0)


def available_memory_bytes() -> int:
    """The memory available now: ``MemAvailable`` of ``/proc/meminfo`` (else the physical memory), at most
    what the process may still map under ``RLIMIT_AS``."""
    left = _address_space_left()
    machine = _machine_available()
    return machine if left is None else min(machine, left)


def _machine_available() -> int:
    try:
        text = Path("/proc/meminfo").read_text(encoding="ascii", errors="replace")
    except OSError:  # not Linux: the physical memory
        text = ""
    for line in text.splitlines():
        fields = line.split()
        if fields[:1] == ["MemAvailable:"] and len(fields) > 1 and fields[1].isdigit():
            return int(fields[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def memory_budget_bytes(options: ImportOptions) -> int:
    """The most bytes one allocation of the import may take (module docstring)."""
    if options.max_memory_bytes is not None:
        return options.max_memory_bytes
    return available_memory_bytes() // 2


def check_allocation(nbytes: int, what: str, *, options: ImportOptions | None, kind: str = "routing ids") -> None:
    """Refuse, before it is made, an allocation of ``nbytes`` over the budget: ``TraceFormatError`` with the
    figure, what asked for it (``what``: "positions up to 16,000,000 of request 3 need 16,000,001 rows"...),
    what the bytes hold (``kind``) and the knob. ``options`` None: the defaults."""
    options = options if options is not None else ImportOptions()
    budget = memory_budget_bytes(options)
    if nbytes > budget:
        src = "--max-memory" if options.max_memory_bytes is not None else "half the available memory"
        raise TraceFormatError(
            f"{what}: {human_bytes(nbytes)} of {kind} in memory, over the import's budget of "
            f"{human_bytes(budget)} ({src}); check the input, or raise the budget with --max-memory GIB"
        )


def check_declared_shape(
    shape: tuple[int, ...], what: str, *, options: ImportOptions | None, copies: int = 1, kind: str = "counts"
) -> None:
    """Refuse a tensor whose declared ``shape`` would take more than the budget once read as ``copies``
    int64 arrays (module docstring: a view's shape counts, not its storage); nothing is read or allocated."""
    numel = math.prod(int(n) for n in shape)
    check_allocation(
        numel * 8 * copies, f"{what} declares shape {list(shape)} ({numel:,} values)", options=options, kind=kind
    )
