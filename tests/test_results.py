"""Result files are typed and versioned (moetrace/results.py): every file `analyze`, `compare` and
`place` write carries its format name and version, and the dashboard dispatches on that format."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from factories import planted_trace
from typer.testing import CliRunner

from moetrace import results as rf
from moetrace.cli import app
from moetrace.dashboards.inputs import detect
from moetrace.errors import TraceFormatError

runner = CliRunner()
DEPLOY = ["--config", "DP2TP4EP8", "--gpus-per-node", "4"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return planted_trace(tmp_path_factory.mktemp("results") / "trace", structured=True)


@pytest.fixture(scope="module")
def analysis_dir(trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "analysis"
    r = runner.invoke(
        app, ["analyze", str(trace), "-o", str(out), "--batch-size", "8", "--embedding-max-requests", "40"]
    )
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def compare_dir(trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "compare"
    r = runner.invoke(
        app,
        [
            "compare",
            str(trace),
            *DEPLOY,
            "--strategies",
            "linear,eplb,data",
            "--batches",
            "10",
            "--batch-requests",
            "8",
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    return out


def _assert_every_file_is_stamped(directory, kind: rf.ResultKind, *, skip: frozenset[str] = frozenset()) -> set[str]:
    """Every file in ``directory`` is a file of ``kind`` carrying the format and version of results.py."""
    names = {p.name for p in directory.iterdir()} - {".writer.lock"}  # the folder's writer lock (reliability.md)
    assert not any(n.startswith(".") for n in names), f"temporary files left behind: {names}"
    assert names <= {kind.manifest, *kind.files}, (
        f"files results.py does not list: {names - {kind.manifest, *kind.files}}"
    )
    for name in sorted(names - skip):
        path = directory / name
        if name.endswith(".json"):
            obj = json.loads(path.read_text())
            got = (obj.get("format"), obj.get("version"))
            assert list(obj)[:2] == ["format", "version"], name
        else:
            got = rf.read_table_format(path)
            assert pq.read_schema(path).metadata[b"moetrace.version"] == str(kind.version).encode()
        assert got == (rf.file_format(kind, name), kind.version), name
    return names


def test_analyze_writes_every_file_with_format_and_version(analysis_dir):
    names = _assert_every_file_is_stamped(analysis_dir, rf.ANALYSIS)
    assert {
        "manifest.json",
        "summary.json",
        "imbalance.parquet",
        "embedding.parquet",
        "classify_accuracy.parquet",
        "affinity.parquet",
        "coactivation.parquet",
    } <= names
    assert json.loads((analysis_dir / "summary.json").read_text())["format"] == "moetrace.analysis.summary"
    assert rf.read_table_format(analysis_dir / "imbalance.parquet") == ("moetrace.analysis.imbalance", 1)
    man = json.loads((analysis_dir / "manifest.json").read_text())
    assert (man["format"], man["version"]) == ("moetrace.analysis", 1)
    assert set(man["files"]) == names - {"manifest.json"}


def test_counts_table_carries_format_and_version(trace, tmp_path):
    r = runner.invoke(app, ["analyze", str(trace), "-o", str(tmp_path), "--only", "counts"])
    assert r.exit_code == 0, r.output
    assert rf.read_table_format(tmp_path / "counts.parquet") == ("moetrace.analysis.counts", 1)


def test_compare_writes_every_file_with_format_and_version(compare_dir):
    names = _assert_every_file_is_stamped(compare_dir, rf.COMPARE)
    assert names == {rf.COMPARE_MANIFEST, *rf.COMPARE.files}
    assert rf.read_table_format(compare_dir / "layers.parquet") == ("moetrace.compare.layers", 1)
    kind, manifest = rf.read_result_manifest(compare_dir)
    assert kind is rf.COMPARE and manifest["strategies"] == ["linear", "eplb", "data"]


def test_place_writes_a_versioned_placement_file(trace, tmp_path):
    out = tmp_path / "p.json"
    r = runner.invoke(app, ["place", str(trace), *DEPLOY, "--strategy", "improved", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("improved placement for DP2TP4EP8: 16 slots x 2 layers, router match ")
    obj = json.loads(out.read_text())
    assert (obj["format"], obj["version"]) == (rf.PLACEMENT.format, rf.PLACEMENT.version) == ("moetrace.placement", 1)
    kind, _ = rf.read_result_manifest(out)
    assert kind is rf.PLACEMENT


def test_dashboard_detection_dispatches_on_format(analysis_dir, compare_dir, tmp_path):
    assert detect(analysis_dir).kind == "analysis"
    assert detect(compare_dir).kind == "placement"
    # keys alone do not make a compare result: the same manifest under another format is refused
    d = tmp_path / "renamed"
    d.mkdir()
    obj = json.loads((compare_dir / "compare.json").read_text())
    (d / "compare.json").write_text(json.dumps({**obj, "format": "moetrace.something"}))
    with pytest.raises(
        TraceFormatError, match=r"not a trace, analysis or placement result directory.*moetrace.something"
    ):
        detect(d)
    # an analysis manifest is recognised by its format even if it lacks the usual keys
    a = tmp_path / "bare-analysis"
    a.mkdir()
    (a / "manifest.json").write_text(json.dumps({"format": "moetrace.analysis", "version": 1}))
    assert detect(a).kind == "analysis"


def test_old_compare_json_without_format_gets_one_clean_line(compare_dir, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    obj = json.loads((compare_dir / "compare.json").read_text())
    del obj["format"], obj["version"]
    (old / "compare.json").write_text(json.dumps(obj))
    with pytest.raises(TraceFormatError) as exc:
        detect(old)
    msg = str(exc.value)
    assert "\n" not in msg and "older moetrace" in msg and "re-run `moetrace compare`" in msg
    r = runner.invoke(app, ["dashboard", str(old), "-o", str(tmp_path / "r.html")])
    assert r.exit_code == 2 and "older moetrace" in r.output and "Traceback" not in r.output


def test_unsupported_versions_are_refused(compare_dir, tmp_path):
    newer = tmp_path / "newer"
    newer.mkdir()
    obj = json.loads((compare_dir / "compare.json").read_text())
    (newer / "compare.json").write_text(json.dumps({**obj, "version": 99}))
    with pytest.raises(
        TraceFormatError, match=r"moetrace.compare version 99 is not supported .*re-run `moetrace compare`"
    ):
        detect(newer)
    with pytest.raises(TraceFormatError, match="no such file or directory"):
        rf.read_result_manifest(tmp_path / "missing")
    with pytest.raises(TraceFormatError, match="holds no manifest.json or compare.json"):
        rf.read_result_manifest(tmp_path)


def test_every_kind_is_one_consistent_entry():
    assert [k.name for k in rf.KINDS] == ["analysis", "compare", "placement", "a2a", "advice"]
    assert len({k.format for k in rf.KINDS}) == len(rf.KINDS)
    for k in rf.KINDS:
        assert rf.kind_of_format(k.format) is k
        assert len(set(k.files)) == len(k.files) and k.manifest not in k.files
        for name in k.files:
            assert rf.file_format(k, name).startswith(k.format + ".")
    with pytest.raises(ValueError, match="list it in moetrace/results.py"):
        rf.file_format(rf.COMPARE, "unknown.parquet")


# ---------------------------------------------------------------- compare.json, typed (placement/compare_manifest.py)
GOLDEN_COMPARE = Path(__file__).parent / "golden" / "compare_v1" / "compare.json"


def test_compare_json_is_read_and_written_through_its_typed_record(compare_dir, tmp_path):
    """A compare.json written by the previous moetrace reads into CompareManifest and writes back the
    same bytes; the run's own compare.json reads back into what the dashboard and summary use."""
    from moetrace.placement.compare_manifest import CompareManifest, read_compare_manifest

    obj = json.loads(GOLDEN_COMPARE.read_text())
    m = read_compare_manifest(GOLDEN_COMPARE)
    assert (m.deployment, m.num_nodes, m.reference, m.expert_copy_floor) == ("DP2TP4EP8", 2, "linear", 0.0)
    assert m.bounds == ("perfect_routing", "oracle") and m.grouping["data"].cluster_to_groups == ((0,), (1,))
    out = rf.write_result_json(tmp_path, rf.COMPARE, rf.COMPARE_MANIFEST, m.to_json())
    assert out.read_bytes() == GOLDEN_COMPARE.read_bytes()
    ours = read_compare_manifest(compare_dir)
    assert ours.strategies == ("linear", "eplb", "data") and ours.model.name == "planted"
    assert detect(compare_dir).compare == ours
    # the verdict and the step model are records too, written back key for key
    assert ours.verdict is not None and ours.verdict.ranking and set(ours.verdict.stages) >= {"decode"}
    assert ours.hardware is not None and ours.hardware.name == "h100" and "expert" in ours.hardware.kernels
    own = {
        k: v
        for k, v in json.loads((compare_dir / rf.COMPARE_MANIFEST).read_text()).items()
        if k not in ("format", "version")
    }
    assert ours.to_json() == own
    assert CompareManifest.from_json(obj, where="x").to_json() == {
        k: v for k, v in obj.items() if k not in ("format", "version")
    }


@pytest.mark.parametrize(
    ("part", "value", "message"),
    [
        ("verdict", {"measure": "moe_time"}, r"compare.json verdict: no `ranking`; re-run `moetrace compare`"),
        ("verdict", {"stages": {"decode": {"stage": "decode"}}}, r"`verdict.stages` holds a malformed decision"),
        ("hardware", {"format": "x"}, r"compare.json: `hardware`: not a moetrace links file"),
    ],
)
def test_a_damaged_verdict_or_step_model_names_its_key(compare_dir, part, value, message):
    from moetrace.placement.compare_manifest import CompareManifest

    obj = json.loads((compare_dir / rf.COMPARE_MANIFEST).read_text())
    obj[part] = {**obj[part], **value} if part == "verdict" and "stages" in value else value
    with pytest.raises(TraceFormatError, match=message):
        CompareManifest.from_json(obj, where="compare.json")


def test_compare_json_of_older_moetrace_gets_the_later_keys_once(tmp_path):
    from moetrace.placement.compare_manifest import LATER_KEYS, read_compare_manifest

    obj = json.loads(GOLDEN_COMPARE.read_text())
    for key in LATER_KEYS:  # compare.json as written before the bounds, the floor and the cost model
        obj.pop(key, None)
    (tmp_path / "compare.json").write_text(json.dumps(obj))
    m = read_compare_manifest(tmp_path)
    assert (m.oracle, m.bounds, m.bound_kinds, m.expert_copy_floor) == (False, (), {}, None)
    assert "expert_copy_floor" not in m.to_json() and not m.has_time and "links" not in m.to_json()


@pytest.mark.parametrize(
    "corrupt, fragment",
    [
        (lambda d: d.pop("num_nodes"), "no `num_nodes`; re-run `moetrace compare`"),
        (lambda d: d.__setitem__("num_batches", "10"), "`num_batches` is '10', expected int"),
        (lambda d: d.__setitem__("oracle", 1), "`oracle` is 1, expected bool"),
        (lambda d: d["model"].pop("top_k"), "lacks ['top_k']"),
        (lambda d: d["grouping"]["data"].pop("num_clusters"), "grouping 'data': no `num_clusters`"),
    ],
)
def test_broken_compare_json_is_one_clean_line(corrupt, fragment, tmp_path):
    obj = json.loads(GOLDEN_COMPARE.read_text())
    corrupt(obj)
    (tmp_path / "compare.json").write_text(json.dumps(obj))
    with pytest.raises(TraceFormatError, match=re.escape(fragment)):
        detect(tmp_path)
    out = tmp_path.parent / f"{tmp_path.name}.html"  # not inside its input (reliability.md)
    r = runner.invoke(app, ["dashboard", str(tmp_path), "-o", str(out)])
    assert r.exit_code == 2 and fragment in r.output.replace("\n", "") and "Traceback" not in r.output


def test_compare_json_holds_every_compare_config_field():
    """compare.json records the whole configuration: a new CompareConfig field needs its manifest field."""
    from dataclasses import fields

    from moetrace.placement.compare import CompareConfig
    from moetrace.placement.compare_manifest import CompareManifest

    manifest = [f.name for f in fields(CompareManifest)]
    config = [f.name for f in fields(CompareConfig) if f.name != "deployment"]
    assert manifest[: len(config)] == config


def test_results_record_their_trace_relative_never_absolute(tmp_path):
    """No absolute path of the user's machine in result files (issue #26): compare.json and the
    placement file record the trace relative to where they are written, and read back to it."""
    from typer.testing import CliRunner

    from moetrace.cli import app
    from moetrace.placement.compare_manifest import read_compare_manifest
    from moetrace.results import resolve_recorded

    runner = CliRunner()
    trace = tmp_path / "traces" / "t"
    r = runner.invoke(app, ["synth", "--model", "olmoe-1b-7b-tiny", "--requests", "40", "-o", str(trace), "-q"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "results" / "cmp"
    common = ["--config", "DP2TP1EP2", "--gpus-per-node", "1", "-q"]
    r = runner.invoke(app, ["compare", str(trace), *common, "--strategies", "linear,eplb", "--batches", "5",
                            "--no-oracle", "-o", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["place", str(trace), *common, "--strategy", "eplb", "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    for f in (out / "compare.json", tmp_path / "p.json"):
        assert str(tmp_path) not in f.read_text(), f
    recorded = read_compare_manifest(out).trace
    assert recorded == "../../traces/t" and resolve_recorded(recorded, results_dir=out) == trace
    assert json.loads((tmp_path / "p.json").read_text())["source"]["trace"] == "traces/t"
