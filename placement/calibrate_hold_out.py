"""Which measured rows a calibration holds out of the fit (``--hold-out``; docs/placement.md, "Calibration").

Hold-out syntax (``parse_hold_out``): ``TERM[,TERM...]`` holds out the rows matching every term;
``;`` separates alternatives (a row matching any group is held out). A term is ``FIELD OP VALUE``
with ``OP`` one of ``= != < <= > >=`` (``=``/``!=`` take ``a|b`` lists) over the fields ``kernel gpu
ep gpn nodes hidden topk experts tokens dispatch_type combine_type routing``, or ``every=N``
(every N-th row of the input, the N-th, 2N-th, ...). Examples: ``tokens>=256``, ``gpu=h200``,
``every=5``, ``kernel=deepep-ll,nodes>1``.

Out of scope: what the held-out rows are used for (``calibrate_fit`` predicts them, never fits them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from moetrace.errors import ConfigError
from moetrace.placement.kernel_tables import KernelRow

__all__ = ["HoldOut", "parse_hold_out"]

_FIELDS: dict[str, Callable[[KernelRow], Any]] = {
    "kernel": lambda r: r.kernel,
    "gpu": lambda r: r.gpu,
    "ep": lambda r: r.ep_size,
    "gpn": lambda r: r.gpus_per_node,
    "nodes": lambda r: r.nodes,
    "hidden": lambda r: r.hidden,
    "topk": lambda r: r.top_k,
    "experts": lambda r: r.num_experts,
    "tokens": lambda r: r.tokens_per_rank,
    "dispatch_type": lambda r: r.dispatch_type,
    "combine_type": lambda r: r.combine_type,
    "routing": lambda r: r.routing,
}
_OPS = {
    "=": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}
HoldOut = Callable[[KernelRow, int], bool]


def _term(text: str, spec: str) -> HoldOut:
    m = re.fullmatch(r"\s*([a-z_]+)\s*(!=|<=|>=|=|<|>)\s*([^\s].*?)\s*", text)
    if not m:
        raise ConfigError(
            f"--hold-out {spec!r}: cannot read {text!r}; write FIELD OP VALUE (e.g. tokens>=256, gpu=h200) or every=N"
        )
    name, op, value = m.groups()
    if name == "every":
        if op != "=" or not (value.isascii() and value.isdigit() and len(value) <= 9) or int(value) < 2:
            raise ConfigError(f"--hold-out {spec!r}: every=N needs a whole N >= 2")
        n = int(value)
        return lambda row, i: (i + 1) % n == 0
    if name not in _FIELDS:
        raise ConfigError(f"--hold-out {spec!r}: unknown field {name!r}; use {', '.join(_FIELDS)} or every")
    get = _FIELDS[name]
    numeric = name in ("ep", "gpn", "nodes", "hidden", "topk", "experts", "tokens")
    values = value.split("|") if op in ("=", "!=") else [value]
    try:
        if numeric and not all(v.isascii() and len(v) <= 19 for v in values):  # int() takes '٣' and 4,300 digits
            raise ValueError(value)
        parsed = [int(v) if numeric else v.lower() for v in values]
    except ValueError:
        raise ConfigError(f"--hold-out {spec!r}: {name} takes whole numbers, got {value!r}") from None
    if not numeric and op not in ("=", "!="):
        raise ConfigError(f"--hold-out {spec!r}: {name} takes = or != only")
    if op == "=":
        return lambda row, i: get(row) in parsed
    if op == "!=":
        return lambda row, i: get(row) not in parsed
    cmp, bound = _OPS[op], parsed[0]
    return lambda row, i: cmp(get(row), bound)


def parse_hold_out(spec: str | None) -> HoldOut | None:
    """The rule of a hold-out spec (module docstring): ``rule(row, index) -> held out``; None: none."""
    if spec is None or not spec.strip():
        return None
    groups = []
    for alt in spec.split(";"):
        terms = [_term(t, spec) for t in alt.split(",") if t.strip()]
        if not terms:
            raise ConfigError(f"--hold-out {spec!r}: an empty alternative")
        groups.append(terms)
    return lambda row, i: any(all(t(row, i) for t in terms) for terms in groups)
