"""The dashboard's section table (``moetrace.dashboards.sections``): the report, the CLI's help and
docs/dashboards.md read one table, so adding a section is one module, one row, docs and a test."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from browser.fixtures import produced
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.dashboards.inputs import DRAWN, InputKind
from moetrace.dashboards.report import write_dashboard
from moetrace.dashboards.sections import INPUT_KINDS, SECTIONS, kind_row, section_row

DOCS = Path(__file__).resolve().parents[1] / "docs" / "dashboards.md"


def _docs_table() -> list[tuple[str, ...]]:
    """The rows of the table under "## The section table" in docs/dashboards.md, backticks stripped."""
    text = DOCS.read_text().split("## The section table", 1)[1]
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append(tuple(c.strip().strip("`") for c in line.strip("|").split("|")))
        elif rows and not line.startswith("|"):
            break
    return rows[1:]  # the header row off


def test_the_docs_list_every_section_row():
    assert _docs_table() == [(r.key, r.title, r.needs, r.builder) for r in SECTIONS], (
        "docs/dashboards.md's section table differs from dashboards/sections.py SECTIONS"
    )
    what = DOCS.read_text().split("## Sections and exactly what they draw", 1)[1]
    for row in SECTIONS:  # and each has its paragraph of what it draws
        assert f"**{row.title}** (" in what, row.title


def test_every_row_builds_from_a_known_input_kind():
    kinds = {k.kind for k in INPUT_KINDS}
    assert kinds == set(typing.get_args(InputKind)) == {"trace", *DRAWN.values()}
    assert len({k.prefix for k in INPUT_KINDS}) == len(INPUT_KINDS)
    assert len({r.key for r in SECTIONS}) == len(SECTIONS)
    for row in SECTIONS:
        assert row.needs in kinds and callable(row.build()), row
        assert section_row(row.key) is row and kind_row(row.needs).kind == row.needs
    with pytest.raises(KeyError, match="no dashboard section 'nope'; sections: advice, placement"):
        section_row("nope")


def test_the_command_help_names_every_section_and_input_kind():
    out = re.sub(r"\s+", " ", CliRunner().invoke(app, ["dashboard", "--help"], terminal_width=200).output)
    for row in SECTIONS:
        assert row.title.lower() in out.lower(), row.title
    for k in INPUT_KINDS:
        if k.kind != "trace":
            assert f"`{k.command}`" in out, k.command


def test_the_page_holds_the_rows_sections_in_table_order_with_their_titles(tmp_path):
    prod = produced()
    rep = write_dashboard([prod.trace, prod.analysis, prod.compare], out=tmp_path / "r.html")
    order = [r.key for r in SECTIONS]
    assert list(rep.sections) == sorted(rep.sections, key=order.index)
    text = rep.path.read_text()
    for key in rep.sections:
        assert f'<section id="{key}"><h2>{section_row(key).title}</h2>' in text, key
