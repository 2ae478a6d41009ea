"""The house rules of docs/architecture.md: import contracts, no cycles, one import name everywhere.

- the stage order (trace format <- producers; trace <- analysis <- placement <- dashboards; CLI on
  top) holds, checked by import-linter against the contracts in pyproject.toml;
- no two modules import each other, directly or round a loop (function-level imports included);
- the folder -> import-name mapping works from a plain checkout (no install), from a wheel built
  from a clean copy of the tracked files, and from `pip install .`; the wheel holds exactly the
  packages and data files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tracer", "analysis", "placement", "dashboards", "data")
EVIDENCE = "import moetrace.tracer, moetrace.analysis, moetrace.placement, moetrace.dashboards"


def test_import_contracts_hold():
    from importlinter.cli import lint_imports

    cwd = os.getcwd()
    os.chdir(ROOT)  # import-linter reads the contracts from ./pyproject.toml
    try:
        assert lint_imports(no_cache=True, no_logo=True) == 0, "an import breaks the stage order (run `lint-imports`)"
    finally:
        os.chdir(cwd)


def test_no_import_cycles():
    import grimp

    graph = grimp.build_graph("moetrace")
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph.modules):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_stage_folder_is_linked_into_the_package():
    for stage in STAGES:
        link = ROOT / "moetrace" / stage
        assert link.is_symlink() and os.readlink(link) == f"../{stage}", f"moetrace/{stage} must link to ../{stage}"
        assert (ROOT / stage / "__init__.py").is_file()


def test_plain_checkout_imports_without_an_install():
    """`python -S` (no site-packages, so no editable install) from the repository root."""
    code = (
        f"import sys; {EVIDENCE}, moetrace.atomic, moetrace.errors; "
        "assert not any('site-packages' in p for p in sys.path); "
        "import moetrace.tracer as t; print(t.__file__)"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    assert Path(out.stdout.strip()) == ROOT / "moetrace" / "tracer" / "__init__.py"


def test_a_stage_folder_refuses_its_bare_name():
    code = "import sys; sys.path.insert(0, '.'); import tracer"
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "import it as moetrace.tracer" in r.stderr


def _clean_copy(dest: Path) -> Path:
    """The files a fresh clone has (tracked and not ignored), symlinks kept as links."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = ROOT / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dest / rel)
        else:
            shutil.copy2(src, dest / rel)
    return dest


def _pip(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "-q"], cwd=cwd, check=True)


@pytest.fixture(scope="module")
def clean_checkout(tmp_path_factory):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the clean-copy packaging tests need `git ls-files`")
    return _clean_copy(tmp_path_factory.mktemp("checkout"))


def _expected_packages(root: Path) -> set[str]:
    """Every folder with an __init__.py under moetrace/, following the stage links."""
    pkgs = set()
    for d, _dirs, files in os.walk(root / "moetrace", followlinks=True):
        if "__init__.py" in files and "__pycache__" not in d:
            pkgs.add(Path(d).relative_to(root).as_posix())
    return pkgs


def test_wheel_from_a_clean_checkout_holds_exactly_the_packages(clean_checkout, tmp_path):
    _pip("wheel", ".", "-w", str(tmp_path), cwd=clean_checkout)
    (whl,) = tmp_path.glob("moetrace-*.whl")
    names = [n for n in zipfile.ZipFile(whl).namelist() if ".dist-info/" not in n]
    assert {n.split("/")[0] for n in names} == {"moetrace"}
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packages == _expected_packages(clean_checkout)
    code_files = {n for n in names if n.endswith(".py")}
    source_files = {
        p.relative_to(clean_checkout).as_posix() for pkg in packages for p in (clean_checkout / pkg).glob("*.py")
    }
    assert code_files == source_files, "wheel modules differ from the tracked sources (stale build/ output?)"
    data = {n for n in names if not n.endswith(".py")}
    bundled = {
        p.relative_to(clean_checkout).as_posix()
        for p in (clean_checkout / "moetrace" / "data").rglob("*")
        if p.is_file() and (p.suffix in (".json", ".jsonl", ".csv", ".parquet") or p.name.startswith("LICENSE"))
    }
    assert data == bundled | {"moetrace/py.typed"}  # PEP 561: type checkers use the package's own hints
    code = (
        f"import sys; sys.path.insert(0, {str(whl)!r}); {EVIDENCE}; import moetrace.tracer.presets as p; "
        "assert '.whl' in p.__file__, p.__file__; print(p.model_info_for('deepseek-v3-tiny').num_moe_layers)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.strip() == "58"


def test_pip_install_from_a_clean_checkout(clean_checkout, tmp_path):
    target = tmp_path / "site"
    _pip("install", ".", "--target", str(target), cwd=clean_checkout)
    assert not any((target / generic).exists() for generic in STAGES), "a generic top-level package was installed"
    code = (
        f"import sys; sys.path.insert(0, {str(target)!r}); {EVIDENCE}; import moetrace.cli, moetrace.tracer.trace as t; "
        f"assert t.__file__.startswith({str(target)!r}), t.__file__"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
