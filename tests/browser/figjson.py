"""Read the figures back out of a dashboard's HTML without a browser (plotly JSON, typed arrays decoded)."""

from __future__ import annotations

import base64
import html
import json
import re
from typing import Any

import numpy as np

_BLOCK = re.compile(
    r'<div class="figure" id="([^"]+)" data-key="([^"]+)" data-source="([^"]*)"[^>]*></div>\s*'
    r'<script type="application/json" class="figure-json" data-target="\1">(.*?)</script>',
    re.S,
)


def decode(value: Any) -> Any:
    """A plotly typed-array spec (``{"dtype", "bdata", "shape"}``) as a numpy array; anything else as is."""
    if isinstance(value, dict) and "bdata" in value and "dtype" in value:
        arr = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        if "shape" in value:
            shape = tuple(int(s) for s in str(value["shape"]).split(","))
            arr = arr.reshape(shape)
        return arr
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    return value


def figures_from_html(text: str) -> dict[str, dict[str, Any]]:
    """``{figure key: {"source", "data", "layout"}}`` of every figure in a report."""
    out = {}
    for _div, key, source, body in _BLOCK.findall(text):
        fig = json.loads(body.replace("<\\/", "</"))
        out[html.unescape(key)] = {
            "source": html.unescape(source),
            "data": [decode(t) for t in fig["data"]],
            "layout": fig["layout"],
        }
    return out
