"""README.md and docs/*.md name only files that ship with the repository.

Checked: every relative Markdown link (``[text](path)``, relative to the page) and every path in code
(inline or fenced) that starts with one of the repository's top-level folders (relative to the
repository root, how the docs write them), except the few that cite another project's files
(``OTHER_PROJECTS``); placeholders (``<name>``, ``{r}``, ``*``, ``...``) are
skipped. No page names a path of the machine it was written on (``/work/...``, ``../shared``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("tracer", "analysis", "placement", "dashboards", "data", "moetrace", "tests", "benchmarks", "docs", ".ci")
REPO_PATH = re.compile(r"^(?:\./)?(?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", flags=re.S)
MACHINE_PATHS = re.compile(r"/work/|\.\./shared|/home/\w|/root/")
#: paths in code that name another project's file, not ours: path -> whose
OTHER_PROJECTS = {"docs/training/routed_experts_replay.md": "vLLM's docs (docs/collecting.md cites v0.21.0)"}


def _ids(pages: list[Path]) -> list[str]:
    return [p.relative_to(ROOT).as_posix() for p in pages]


def links(text: str) -> list[str]:
    """Relative link targets of a page, without their #anchor."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, mailto:, an anchor on the same page
        out.append(target.split("#", 1)[0])
    return out


def code_paths(text: str) -> list[str]:
    """Repository paths written in code, inline or fenced."""
    out = []
    for fenced, inline in CODE.findall(text):
        for token in re.split(r"[\s,;()=\"'\[\]]+", fenced or inline):
            token = token.split("::", 1)[0].rstrip(".:")
            if REPO_PATH.match(token) and not re.search(r"[<{*]|\.\.\.", token):
                out.append(token)
    return out


def test_the_checks_see_links_and_paths():
    text = "see [the format](trace-format.md#x), [a](https://x.org), `tracer/trace/reader.py::open_trace`\n"
    assert links(text) == ["trace-format.md"]
    assert code_paths(text) == ["tracer/trace/reader.py"]
    assert code_paths("```bash\npython benchmarks/bench_x.py --out out/x\n```") == ["benchmarks/bench_x.py"]
    assert code_paths("`tracer/importers/<name>.py`") == []


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_relative_link_exists(page):
    text = page.read_text(encoding="utf-8")
    missing = [t for t in links(text) if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_repository_path_in_code_exists(page):
    text = page.read_text(encoding="utf-8")
    missing = sorted({p for p in code_paths(text) if not (ROOT / p).exists() and p not in OTHER_PROJECTS})
    assert not missing, f"{page.name} names repository files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_no_path_of_the_writers_machine(page):
    hits = [line for line in page.read_text(encoding="utf-8").splitlines() if MACHINE_PATHS.search(line)]
    assert not hits, f"{page.name} names paths outside the repository: {hits}"
