"""What each column of ``compare``'s and ``advise``'s tables means, said once: printed under the
tables and in the commands' ``--help`` (plain text, no dependency: ``--help`` imports it).

Out of scope: the tables themselves (``report``, ``advise.files``).
"""

from __future__ import annotations

import textwrap

__all__ = ["ADVISE_LEGEND", "COMPARE_LEGEND", "WORSE", "help_epilog", "legend_lines"]

#: the mark after a figure worse than the reference's (linear's) median
WORSE = "+"

COMPARE_LEGEND: tuple[tuple[str, str], ...] = (
    (
        "MoE time",
        "predicted MoE-layer time per step (dispatch + the slowest GPU's experts + combine, all MoE layers), "
        "median over held-out steps over linear's; p10/p90: its spread over steps. The objective every "
        "decision ranks by",
    ),
    ("a2a time", "predicted all-to-all time (dispatch + combine) alone, likewise"),
    ("inter B", "inter-node bytes per step over linear's (/step: the bytes themselves)"),
    (
        "router",
        "held-out requests whose prompt picks the cluster their generated tokens fit best (grouped "
        "strategies; - without a router)",
    ),
    ("node load", "held-out requests sent to the busiest node over an even share (1.00: even; ! over --max-node-load)"),
    ("GPU load", "the busiest GPU's (token, expert) pairs over the mean GPU's, mean over steps and layers"),
    (
        "of oracle",
        "the share of the oracle bound's saving in MoE time this row reaches (100 %: as good as the bound; "
        ">100 % means the bound was beaten, <0 % slower than linear)",
    ),
    (WORSE, "after a figure: worse than linear's"),
)

ADVISE_LEGEND: tuple[tuple[str, str], ...] = (
    (
        "balanced",
        "vLLM's balancedness: mean over max (token, expert) pairs per EP rank, summed over layers, median "
        "over steps (1.0: every rank equally loaded)",
    ),
    ("busiest", "(token, expert) pairs of the busiest EP rank per step and layer"),
    (
        "act/GPU",
        "experts with a token on the GPU activating most: one weight read each in a memory-bound decode step "
        "(a redundant slot can add one)",
    ),
    ("ranks/tok", "distinct EP ranks holding one token's experts, its own included (n/a on a profile)"),
    ("MoE time", "predicted MoE-layer time per step over the reference's median [p10, p90 over steps]"),
    ("inter B", "inter-node bytes per step over the reference's"),
    ("moved", "weights copied once to switch from the reference (expert copies x expert bytes)"),
)


def legend_lines(legend: tuple[tuple[str, str], ...], *, width: int = 100, indent: str = "  ") -> list[str]:
    """``legend:`` then one wrapped entry per column, ``indent`` first."""
    name_w = max(len(n) for n, _ in legend)
    lines = [f"{indent}legend:"]
    for name, text in legend:
        head = f"{indent}  {name:<{name_w}}  "
        lines += textwrap.wrap(text, width=width, initial_indent=head, subsequent_indent=" " * len(head))
    return lines


def help_epilog(legend: tuple[tuple[str, str], ...], *, title: str) -> str:
    """The legend as a ``--help`` epilog within 78 columns (``\\b``: click keeps the lines as they are)."""
    return "\b\n" + title + "\n" + "\n".join(legend_lines(legend, width=78, indent=""))[len("legend:") + 1 :]
