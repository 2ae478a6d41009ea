"""The typed result records the dashboard reads, by the names it imports them under: ``a2a.json``
(``placement.a2a_manifest``: ``A2AManifest`` and its ``A2ASummaryRow``), ``advice.json``
(``placement.advise_manifest``: ``AdviceManifest``, its ``AdviceVerdict``, ``Recommended``,
``AdviceCommand`` and ``DriftEstimate``) and ``options.parquet``'s rows (``placement.advise_option_row``:
``OptionRow``, its times read by ``Measure``). ``compare.json`` is
``placement.compare_manifest.CompareManifest``, compare's ``summary.parquet`` rows
``placement.compare_row.CompareRow``.

The records live beside their writers (``placement.replay.results.write_a2a_results``,
``placement.advise.files.write_advice``), which build them and write through their ``to_json``
(``to_row``); the dashboard reads their fields, never the JSON's keys or the table's column names.

Out of scope: the records themselves (their modules above); recognising result directories (``inputs``).
"""

from __future__ import annotations

from moetrace.placement.a2a_manifest import A2A_LATER_KEYS, A2AManifest, A2ASummaryRow
from moetrace.placement.advise_manifest import (
    ADVICE_LATER_KEYS,
    AdviceCommand,
    AdviceManifest,
    AdviceVerdict,
    DriftEstimate,
    Recommended,
)
from moetrace.placement.advise_option_row import Measure, OptionRow
from moetrace.placement.compare_row import CompareRow

__all__ = [
    "A2A_LATER_KEYS",
    "ADVICE_LATER_KEYS",
    "A2AManifest",
    "A2ASummaryRow",
    "AdviceCommand",
    "AdviceManifest",
    "AdviceVerdict",
    "CompareRow",
    "DriftEstimate",
    "Measure",
    "OptionRow",
    "Recommended",
]
