"""Kill injection at every step of the replacing writers (issue 38): a folder replaced as a whole
(``moetrace.atomic.replacing_directory``: ``analyze``, ``a2a``, ``export``'s bundles, ``import --overwrite``)
holds exactly the old or exactly the new contents whatever step a kill stops it at, and the import swap
never leaves ``-o`` missing (on Linux one exchange; the two-rename fallback is repaired by the next run).

A kill is simulated by raising ``Killed`` (a ``BaseException`` no handler catches) at step *i* and at
every later step of the same kind (a dead process does nothing more): the exchange, each rename, the
removal of the old folder (the injections: tests/kills.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from factories import tree_hashes, write_small_trace
from kills import DyingOs, Killed, die_at_exchange, die_at_rmtree, no_exchange
from typer.testing import CliRunner

from moetrace import atomic
from moetrace.cli import app
from moetrace.tracer.trace.validate import find_problems

runner = CliRunner()


def _folder(path: Path, files: dict[str, str]) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


OLD = {"a.txt": "old a", "b.txt": "old b"}
NEW = {"a.txt": "new a", "c.txt": "new c"}


def _replace(target: Path) -> None:
    with atomic.replacing_directory(target) as building:
        for name, text in NEW.items():
            (building / name).write_text(text)


def _contents(target: Path) -> dict[str, str] | None:
    if not target.exists():
        return None
    return {p.name: p.read_text() for p in target.iterdir()}


# ---------------------------------------------------------------------------------------- the mechanism
def test_exchange_is_atomic_on_this_machine(tmp_path):
    a, b = _folder(tmp_path / "a", {"x": "1"}), _folder(tmp_path / "b", {"y": "2"})
    if not atomic.exchange_paths(a, b):
        pytest.skip("this file system cannot exchange (the two-rename fallback is tested below)")
    assert _contents(a) == {"y": "2"} and _contents(b) == {"x": "1"}


@pytest.mark.parametrize(
    "kill, expect",
    [(die_at_exchange, OLD), (die_at_rmtree, NEW)],
    ids=["at the exchange", "removing the old folder"],
)
def test_a_kill_at_each_step_of_the_exchange(tmp_path, monkeypatch, kill, expect):
    target = _folder(tmp_path / "out", OLD)
    if not atomic.exchange_paths(_folder(tmp_path / "x", {}), _folder(tmp_path / "y", {})):
        pytest.skip("no exchange on this file system")
    kill(monkeypatch)
    with pytest.raises(Killed):
        _replace(target)
    assert _contents(target) == expect


@pytest.mark.parametrize("at", [1, 2])
def test_a_kill_at_each_rename_of_the_fallback(tmp_path, monkeypatch, at):
    target = _folder(tmp_path / "out", OLD)
    no_exchange(monkeypatch)
    monkeypatch.setattr(atomic, "os", DyingOs(at))
    with pytest.raises(Killed):
        _replace(target)
    monkeypatch.undo()
    # rename 1 (old aside) never happened: the old folder; rename 2 (new in) died: missing until recovered
    assert _contents(target) == (OLD if at == 1 else None)
    atomic.recover_directory(target)  # what the next run does first
    assert _contents(target) == OLD
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".old")]


def test_a_kill_removing_the_aside_folder_of_the_fallback(tmp_path, monkeypatch):
    target = _folder(tmp_path / "out", OLD)
    no_exchange(monkeypatch)
    die_at_rmtree(monkeypatch)
    with pytest.raises(Killed):
        _replace(target)
    monkeypatch.undo()
    assert _contents(target) == NEW
    atomic.recover_directory(target)  # removes the finished swap's aside
    assert _contents(target) == NEW and not [p for p in tmp_path.iterdir() if p.name.endswith(".old")]


def test_a_failed_build_leaves_the_old_folder_and_no_temporary(tmp_path):
    target = _folder(tmp_path / "out", OLD)
    with pytest.raises(RuntimeError):
        with atomic.replacing_directory(target) as building:
            (building / "a.txt").write_text("half")
            raise RuntimeError("the build failed")
    assert _contents(target) == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---------------------------------------------------------------------------------------- analyze
def _copy_of(built: Path, tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """A test's own copy of a module's trace ``t`` and results ``a`` (built once: they record each other
    by relative path, so a copy side by side is the same pair)."""
    t, out = tmp_path / "t", tmp_path / "a"
    shutil.copytree(built / "t", t, symlinks=True)
    shutil.copytree(built / "a", out, symlinks=True)
    return t, out, tree_hashes(out)


@pytest.fixture(scope="module")
def _analysed_once(tmp_path_factory) -> Path:
    built = tmp_path_factory.mktemp("analysed")
    t = write_small_trace(built / "t", num_requests=8)
    r = runner.invoke(app, ["analyze", str(t), "-o", str(built / "a"), "--only", "imbalance", "-q"])
    assert r.exit_code == 0, r.output
    return built


@pytest.fixture
def analysed(_analysed_once, tmp_path):
    return _copy_of(_analysed_once, tmp_path)


def _analyze_again(t: Path, out: Path):
    return runner.invoke(app, ["analyze", str(t), "-o", str(out), "--only", "imbalance,affinity", "--overwrite", "-q"])


def _is_new_analysis(out: Path) -> bool:
    return (out / "affinity.parquet").is_file() and (out / "manifest.json").is_file()


@pytest.mark.parametrize(
    "kill, new",
    [(die_at_exchange, False), (die_at_rmtree, True)],
    ids=["at the exchange", "removing the old folder"],
)
def test_analyze_overwrite_killed_at_each_step(analysed, monkeypatch, kill, new):
    t, out, old = analysed
    kill(monkeypatch)
    with pytest.raises(Killed):
        _analyze_again(t, out)
    if new:
        assert _is_new_analysis(out) and tree_hashes(out) != old
    else:
        assert tree_hashes(out) == old


@pytest.mark.parametrize("at", [1, 2])
def test_analyze_overwrite_killed_at_each_rename_of_the_fallback(analysed, monkeypatch, at):
    t, out, old = analysed
    no_exchange(monkeypatch)
    monkeypatch.setattr(atomic, "os", DyingOs(at))
    with pytest.raises(Killed):
        _analyze_again(t, out)
    monkeypatch.undo()
    r = _analyze_again(t, out)  # the next run repairs first, then replaces
    assert r.exit_code == 0, r.output
    assert _is_new_analysis(out) and not [p for p in out.parent.iterdir() if p.name.startswith(".a.")]


def test_analyze_overwrite_that_fails_keeps_the_old_results(analysed):
    t, out, old = analysed
    r = runner.invoke(app, ["analyze", str(t), "-o", str(out), "--only", "nonsense", "--overwrite", "-q"])
    assert r.exit_code == 2, r.output
    assert tree_hashes(out) == old


# ---------------------------------------------------------------------------------------- import
def _tokens(path: Path, experts: list[int]) -> Path:
    import json

    rec = {"request": 0, "layer": 0, "position": 0, "stage": "prefill", "experts": experts}
    path.write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "position": 1, "stage": "decode"}) + "\n")
    return path


@pytest.fixture
def imported(tmp_path):
    out = tmp_path / "t"
    args = ["--model", "olmoe-1b-7b-tiny", "-o", str(out)]
    r = runner.invoke(app, ["import", str(_tokens(tmp_path / "old.jsonl", [1, 2, 3, 4, 5, 6, 7, 8])), *args])
    assert r.exit_code == 0, r.output
    new = _tokens(tmp_path / "new.jsonl", [8, 7, 6, 5, 4, 3, 2, 1])
    return out, tree_hashes(out), ["import", str(new), *args, "--overwrite"]


@pytest.mark.parametrize(
    "kill, new",
    [(die_at_exchange, False), (die_at_rmtree, True)],
    ids=["at the exchange", "removing the old trace"],
)
def test_import_overwrite_killed_at_each_step(imported, monkeypatch, kill, new):
    out, old, args = imported
    kill(monkeypatch)
    with pytest.raises(Killed):
        runner.invoke(app, args)
    assert find_problems(out) == []  # -o is a whole trace, never missing
    assert (tree_hashes(out) != old) if new else (tree_hashes(out) == old)


@pytest.mark.parametrize("at", [1, 2])
def test_import_overwrite_killed_at_each_rename_of_the_fallback(imported, monkeypatch, at):
    out, old, args = imported
    no_exchange(monkeypatch)
    monkeypatch.setattr(atomic, "os", DyingOs(at))
    with pytest.raises(Killed):
        runner.invoke(app, args)
    monkeypatch.undo()
    atomic.recover_directory(out)  # what the next import (or analyze into it) does first
    assert tree_hashes(out) == old and find_problems(out) == []
    r = runner.invoke(app, args)  # and the next import then replaces it
    assert r.exit_code == 0, r.output
    assert tree_hashes(out) != old and find_problems(out) == []
    shutil.rmtree(out)


# ---------------------------------------------------------------------------------------- advise
def _advise_args(t: Path, out: Path, steps: int) -> list[str]:
    """Steps large enough that advise recommends a placement: advice.json then holds commands naming -o."""
    step_tokens = ["--decode-tokens-per-gpu", "64", "--prefill-tokens-per-gpu", "512"]
    deployment = ["--config", "DP2TP2EP4", "--gpus-per-node", "2"]
    return ["advise", str(t), *deployment, *step_tokens, "--steps", str(steps), "-q", "-o", str(out)]


@pytest.fixture(scope="module")
def _advised_once(tmp_path_factory) -> Path:
    from factories import zipf_trace

    built = tmp_path_factory.mktemp("advised")
    t = zipf_trace(built / "t")
    r = runner.invoke(app, _advise_args(t, built / "a", 8))
    assert r.exit_code == 0, r.output
    return built


@pytest.fixture
def advised(_advised_once, tmp_path):
    return _copy_of(_advised_once, tmp_path)


def _advise_again(t: Path, out: Path):
    return runner.invoke(app, [*_advise_args(t, out, 12), "--overwrite"])


def _is_new_advice(out: Path) -> bool:
    """The second run's advice (12 steps), whose commands and placement files name -o, never the folder
    it was built in."""
    from moetrace.placement.advise.files import read_advice

    man = read_advice(out)
    text = "".join(p.read_text() for p in sorted(out.rglob("*.json")))
    return (
        man.num_steps["decode"] == 12
        and f".{out.name}." not in text
        and bool(man.commands)
        and all(c.placement.startswith(f"{out}/") for c in man.commands)
    )


def _beside(out: Path) -> list[str]:
    """What a swap of ``out`` left beside it (its building folder, an old folder set aside)."""
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_advise_names_its_output_folder_not_the_one_it_built_in(advised):
    t, out, _ = advised
    r = _advise_again(t, out)
    assert r.exit_code == 0, r.output
    assert _is_new_advice(out) and not _beside(out)
    assert f".{out.name}." not in r.output  # the printed commands name -o too


@pytest.mark.parametrize(
    "kill, new",
    [(die_at_exchange, False), (die_at_rmtree, True)],
    ids=["at the exchange", "removing the old folder"],
)
def test_advise_overwrite_killed_at_each_step(advised, monkeypatch, kill, new):
    t, out, old = advised
    kill(monkeypatch)
    with pytest.raises(Killed):
        _advise_again(t, out)
    monkeypatch.undo()
    if new:
        assert _is_new_advice(out) and tree_hashes(out) != old
    else:
        assert tree_hashes(out) == old
    assert not _beside(out)  # the building folder is gone (the guard removes it when the process dies)


@pytest.mark.parametrize("at", [1, 2])
def test_advise_overwrite_killed_at_each_rename_of_the_fallback(advised, monkeypatch, at):
    t, out, old = advised
    no_exchange(monkeypatch)
    monkeypatch.setattr(atomic, "os", DyingOs(at))
    with pytest.raises(Killed):
        _advise_again(t, out)
    monkeypatch.undo()
    atomic.recover_directory(out)  # what the next run does first
    assert tree_hashes(out) == old and not _beside(out)
    r = _advise_again(t, out)  # and the next run then replaces it
    assert r.exit_code == 0, r.output
    assert _is_new_advice(out) and not _beside(out)


def test_advise_overwrite_that_fails_while_writing_keeps_the_old_results(advised, monkeypatch):
    from moetrace.placement import advise

    t, out, old = advised

    def half_written(advice, building, **_kw):
        (Path(building) / "options.parquet").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(advise, "write_advice", half_written)
    r = _advise_again(t, out)
    assert r.exit_code != 0
    assert tree_hashes(out) == old and not _beside(out)
