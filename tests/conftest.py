"""Shared fixtures (small traces written with the real writer, the builders being in ``factories``; a
tiny tmpfs that fills) and the slow tier's list."""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import planted_trace, register_planted_backend, write_small_trace
from hypothesis import settings

# The session's own processes cache bytecode (in __pycache__/, git-ignored) even where the environment sets
# PYTHONDONTWRITEBYTECODE: else every test module is rewritten and compiled anew by each worker, and each of the
# hundreds of `moetrace` processes the tests start compiles the package again.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# property tests check behaviour, not speed (timings live in benchmarks/): no per-example deadline, which a
# loaded 2-core machine trips on the first, import-warming example
settings.register_profile("moetrace", deadline=None)
settings.load_profile("moetrace")


@pytest.fixture
def small_trace(tmp_path):
    return write_small_trace(tmp_path / "trace")


@pytest.fixture(scope="module")
def replay_trace(tmp_path_factory):
    """The structured planted trace the all-to-all replay tests share (40 requests, parity domains)."""
    return planted_trace(tmp_path_factory.mktemp("t") / "planted", structured=True, num_requests=40)


@pytest.fixture
def planted_backend(monkeypatch):
    """Backend ``planted`` registered first (``factories.register_planted_backend``): its built objects
    (``built``) and whether the next one fails (``fail_in_run``)."""
    return register_planted_backend(monkeypatch)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 3 MiB tmpfs mounted at ``tmp_path / "fs"`` for the test (a disk that fills); root only, skipped
    where it cannot be mounted."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ---------------------------------------------------------------- the two tiers
# The slow tier: end-to-end checks that take a second or more each on the 2-core development machine
# (real ranks, namespaces, a browser, real model forward passes, CLI processes started and killed,
# fuzzers and hostile-input tables of a hundred CLI runs, a kernel compiled per id dtype). Plain
# `pytest` runs the fast tier (pyproject's addopts: -m "not slow") on every core (`-n auto`,
# pytest-xdist; `pytest_xdist_auto_num_workers` below); `pytest -m slow` runs this tier, one test at a time (also for one file: `pytest -m slow
# tests/test_demo.py`); the README's test command and CI run both. Module file name -> the test
# functions of it in the tier (every parametrization), or None for the whole file. A test may also
# carry @pytest.mark.slow itself. A fast-tier test that grows past a second moves here (`pytest
# --durations=40` lists them) or is made faster.
SLOW_TESTS: dict[str, tuple[str, ...] | None] = {
    "test_demo.py": None,  # the whole pipeline as `moetrace demo` runs it
    "test_dashboard_browser.py": None,  # a real headless Chromium
    "test_dashboard_a2a.py": None,  # its fixture replays all-to-all on real ranks
    "test_a2a_link.py": None,  # ranks in network namespaces with a shaped link
    "test_a2a_netemu.py": (
        "test_without_namespaces_says_so_and_still_measures_bytes_tpd2",
        "test_replay_on_emulated_nodes_moves_exactly_the_predicted_bytes",
    ),
    "test_a2a.py": (  # real torch.distributed (gloo) ranks
        "test_gloo_collectives_move_exactly_the_predicted_bytes",
        "test_ranking_by_measured_bytes_equals_simulators",
        "test_results_files_carry_format_and_version",
        "test_mismatch_is_a_clean_error",
        "test_payload_errors_are_reported",
        "test_cli_a2a_end_to_end",
        "test_cli_a2a_from_placement_files",
    ),
    "test_progress.py": (
        "test_synth_draws_a_bar_with_rate_and_eta_on_a_terminal",  # `moetrace synth` in a terminal
        "test_import_progress",  # an import's bar, in a child process
    ),
    "test_analysis_run.py": (
        "test_cli_writes_every_result_with_the_documented_columns",  # UMAP's numba compile
        "test_analyze_a_trace_from_the_tiny_model_collector",  # a real tiny model collected, then analysed
        "test_cli_errors_are_clean",  # a dozen CLI runs
        "test_max_requests_analyses_a_stratified_sample_and_says_so",  # analyze twice
    ),
    "test_reliability.py": (
        "test_disk_full",  # writes until a tmpfs is full
        "test_fuzz_placement_files",  # fuzzers: a hundred CLI runs each
        "test_fuzz_the_part_list",
        "test_fuzz_what_stands_at_o",
    ),
    "test_ray_cluster.py": None,  # a two-node Ray cluster (`ray start` x2) running collection shards
    "test_bench_real.py": None,  # the real-data benchmark script, end to end on a tiny capture
    # fuzzers: each example is a whole CLI run
    "test_fuzz.py": None,
    # the hostile-input tables: a CLI run per case, a hundred cases each
    "test_hostile_inputs.py": None,
    "test_hostile_round3.py": None,
    "test_import_megatron.py": ("test_fuzz_router_traces_never_a_traceback",),
    "test_import_sglang_dump.py": ("test_fuzz_dumps_never_a_traceback",),
    "test_import_sglang_pass.py": ("test_fuzz_dumps_import_or_are_refused_never_a_traceback",),
    "test_import_tokens.py": ("test_fuzz_tokens_import_never_a_traceback",),
    # real model forward passes
    "test_hf.py": (
        "test_batched_equals_batch_size_one",
        "test_recorded_experts_are_the_routers_decision",
        "test_deepseek_routing_is_not_a_plain_topk",
        "test_routing_weights_are_recorded_with_the_ids",
    ),
    "test_checkpoint.py": (
        "test_collect_runs_on_the_checkpoint_through_the_cli",
        "test_overwrite_replaces_the_directory_with_the_same_seeded_weights",
    ),
    "test_vllm_convert.py": (  # a collection through the stand-in engine, end to end
        "test_parent_side_before_the_engine_spawn_no_cuda_and_rows_exact",
        "test_user_chosen_multiproc_method_is_kept",
        "test_v021_prefix_caching_off_and_preempted_request_retried_by_resume",
    ),
    # processes started, raced and killed
    "test_writer_lock.py": None,
    "test_reliability_concurrency.py": (
        "test_a_collector_that_loses_a_lock_race_leaves_the_winners_directory",
        "test_a_guard_that_ends_normally_kills_nothing",
        "test_a_results_folder_has_one_writer",
        "test_collect_is_refused_before_it_loads_a_model",
        "test_a_guard_cleans_up_after_a_sigkill",
        "test_merge_shards_is_refused_while_a_whole_trace_writer_runs",
        "test_no_command_writes_into_a_trace_being_collected",
    ),
    "test_hostile_round4.py": ("test_default_budget_follows_rlimit_as",),
    "test_synth.py": (
        "test_trace_is_valid_deterministic_across_workers_and_carries_its_truth",
        "test_calibration_reproduces_published_figures",  # synth at full model shapes
        "test_group_limited_topk_law",
        "test_cli_synth_writes_a_valid_trace_and_reports_errors",
    ),
    "test_synth_mix.py": ("test_cli_mix",),
    "test_replace_kills.py": (  # advise run again at each kill
        "test_advise_overwrite_killed_at_each_step",
        "test_advise_overwrite_killed_at_each_rename_of_the_fallback",
        "test_advise_overwrite_that_fails_while_writing_keeps_the_old_results",
    ),
    # a numba kernel compiled per id dtype
    "test_advise_fused.py": ("test_fused_equals_reference_id_dtypes",),
    "test_jit_fallback.py": ("test_count_numpy_equals_the_kernel",),
    "test_analysis_counts.py": ("test_dtype_grows_with_request_length",),
    # whole commands chained (synth, analyze, compare, advise, place, dashboard)
    "test_advise.py": ("test_the_dashboard_shows_the_advice_first", "test_cli_writes_the_advice_and_prints_verdicts"),
    "test_advise_options.py": ("test_cli_advises_an_imported_sglang_stats_file_with_every_new_option",),
    "test_guards.py": (
        "test_a2a_reports_progress_as_rank_0_finishes_batches",  # real gloo ranks
        "test_compare_has_no_caution_for_real_weights_and_enough_requests",
    ),
    "test_validate_fast.py": (  # a fresh interpreter each
        "test_validate_imports_no_pandas",
        "test_reading_a_trace_imports_no_pandas",
    ),
    "test_collect.py": (
        "test_sigkill_then_resume_loses_nothing_and_duplicates_nothing",  # a collector killed mid-run
        "test_collect_from_a_local_checkpoint_directory",  # real forward passes through the CLI
        "test_refuses_existing_output_and_full_size_model_on_cpu",
        "test_sharded_collection_from_the_cli",
        "test_info_summarizes",
        "test_collect_writes_a_valid_trace_without_text",
    ),
    "test_analysis_metrics.py": ("test_cross_layer_affinity_tracks_its_knob",),
    "test_analysis_tsne.py": ("test_map_is_as_good_as_scikit_learns_barnes_hut",),
    "test_cost_compare.py": ("test_a_deployable_row_that_beats_a_bound_is_reported_never_substituted",),
    "test_dashboard.py": (
        "test_dashboard_on_a_load_profiles_results",
        "test_report_is_one_offline_file",
        "test_random_weight_banner_on_analysis_sections",
        "test_html_figures_equal_result_files",
        "test_progress_counts_sections_and_the_page",
        "test_scatter_cap_is_applied_and_shown",
        "test_two_results_of_one_kind_get_their_own_sections",
    ),
    "test_dashboard_sections.py": ("test_the_page_holds_the_rows_sections_in_table_order_with_their_titles",),
    "test_decision.py": ("test_compare_advise_and_place_name_the_same_best_option_per_stage",),
    "test_import_registry.py": ("test_cli_choices_come_from_the_registry",),
    "test_import_stages.py": (
        "test_decode_only_capture_imports_validates_and_analyses_skip_with_reason",
        "test_placement_on_a_decode_only_trace_refuses_grouped_strategies_and_runs_the_rest",
        "test_prefill_only_capture",
    ),
    "test_one_answer_screens.py": (
        "test_advise_and_compare_name_only_their_own_options",
        "test_every_cost_worse_than_linear_is_marked_in_both_stages",
        "test_heatmap_colour_bars_speak_the_cells_unit",
    ),
    "test_parquet_encoder.py": ("test_cli_synth_with_the_escape_hatch",),
    "test_place_reuse.py": ("test_place_after_compare_writes_what_place_alone_writes",),
    "test_placement_joint.py": ("test_joint_placement_invariants",),
    "test_profile.py": ("test_cli_profile_info_analyze_compare_place_export",),
    "test_results.py": ("test_results_record_their_trace_relative_never_absolute",),
    # pip building a wheel and installing a clean copy of the checkout
    "test_architecture.py": (
        "test_wheel_from_a_clean_checkout_holds_exactly_the_packages",
        "test_pip_install_from_a_clean_checkout",
    ),
}


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many workers ``-n auto`` starts: none (one process, in order) for the slow tier, whose tests hold
    namespaces, ports, a browser or every core themselves, and for a run naming files or tests (a worker's
    start costs more than it saves there); else one per core this process may use, at most 8.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` (pytest-xdist's own setting) overrides."""
    if env := os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(env)
    if (config.option.markexpr or "").strip() == "slow":
        return 0
    here = config.invocation_params.dir
    if config.args and all((here / a.split("::")[0]).is_file() for a in config.args):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, 8) if cores > 1 else 0


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow tier; a file or test in SLOW_TESTS that no longer exists is an error."""
    here = Path(__file__).parent
    if gone_files := [m for m in SLOW_TESTS if not (here / m).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names files tests/ does not hold: {gone_files}")
    checked: set[str] = set()
    for item in items:
        module = item.path.name
        if module not in SLOW_TESTS:
            continue
        names = SLOW_TESTS[module]
        if names is not None and module not in checked:
            checked.add(module)
            gone = [n for n in names if not hasattr(getattr(item, "module", None), n)]
            if gone:
                raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names tests {module} does not define: {gone}")
        if names is None or getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.slow)


# ---------------------------------------------------------------- a per-test timeout
# pytest-timeout is not a dependency: a test running past TEST_TIMEOUT_S seconds (MOETRACE_TEST_TIMEOUT_S
# overrides; 0 turns it off) dumps every thread's traceback to stderr and exits the run, so a hung
# collective or subprocess names itself instead of stalling CI. The slow tier gets SLOW_TIMEOUT_S.
TEST_TIMEOUT_S = 120.0
SLOW_TIMEOUT_S = 900.0


def _terminal_stderr(config: pytest.Config) -> int:
    """The run's own stderr: under pytest's fd capture (the default) fd 2 is a capture file that is lost
    when the run exits, so the capture's saved copy of the terminal's fd 2; without fd capture, fd 2."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    err = getattr(getattr(capman, "_global_capturing", None), "err", None)  # pytest's FDCapture of fd 2
    return int(getattr(err, "targetfd_save", sys.stderr.fileno() if err is None else 2))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    env = os.environ.get("MOETRACE_TEST_TIMEOUT_S")
    limit = float(env) if env else SLOW_TIMEOUT_S if item.get_closest_marker("slow") else TEST_TIMEOUT_S
    if limit > 0:
        faulthandler.dump_traceback_later(limit, exit=True, file=_terminal_stderr(item.config))
    try:
        return (yield)
    finally:
        if limit > 0:
            faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------- mypy beside the slow tier
# `test_tooling.py::test_mypy_is_clean` takes a minute or two of one core from a cold cache; the slow tier's
# long set-ups (the demo, the screenshots' pipeline, Ray) leave the other core mostly idle. So when that
# test is selected, mypy starts as soon as collection ends and the test waits for its result.
_MYPY_KEY = pytest.StashKey[subprocess.Popen]()
MYPY_TEST = "test_tooling.py::test_mypy_is_clean"


def start_mypy(cache_dir: Path) -> subprocess.Popen:
    """``python -m mypy`` over the package (its settings in pyproject.toml), output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache_dir)],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.nodeid.endswith(MYPY_TEST) for item in session.items) and len(session.items) > 1:
        import tempfile

        cache = Path(tempfile.mkdtemp(prefix="moetrace-mypy-cache-"))
        session.config.stash[_MYPY_KEY] = start_mypy(cache)
        session.config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
        session.config.add_cleanup(lambda: session.config.stash[_MYPY_KEY].kill())


@pytest.fixture
def mypy_run(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[int, str]:
    """mypy's exit code and output: from the run started beside the tier, else one started now."""
    proc = request.config.stash.get(_MYPY_KEY, None) or start_mypy(tmp_path / "mypy-cache")
    out, _ = proc.communicate()
    return proc.returncode, out
