"""pytester runs of the gate: baseline pass, fail, update=failed, update=all, bad files."""
from __future__ import annotations

import json

import pytest
from rlk_plugin_testing import latest_run, machine_conftest

from pytest_rlk import storage
from pytest_rlk.schema import Verdict

# Two gated tests; their values come from the environment so one run can regress one of them.
GATED = """
import os

def test_first(rlk_metrics):
    rlk_metrics.record("err", float(os.environ.get("FIRST_ERR", "1e-6")), direction="lower_is_better",
                       space="error", band={"abs_floor": 1e-5, "source": "test tolerance"})
    rlk_metrics.record("step_time_s", [5.0, 1.0, 1.0, 1.0], unit="s", direction="lower_is_better",
                       space="time")

def test_second(rlk_metrics):
    rlk_metrics.set_case("second-case")
    rlk_metrics.record("reward", float(os.environ.get("SECOND_REWARD", "0.5")),
                       direction="higher_is_better", space="reward")
"""
FIRST = "baselines/op/cpu/test_gated.test_first.json"
SECOND = "baselines/op/cpu/second-case.json"


@pytest.fixture
def gated(rlk_pytester, monkeypatch):
    monkeypatch.delenv("FIRST_ERR", raising=False)
    monkeypatch.delenv("SECOND_REWARD", raising=False)
    rlk_pytester.makepyfile(**{"suites/op/test_gated": GATED})
    return rlk_pytester


def _run(pytester, *args):
    return pytester.runpytest("--rlk-platform=cpu", *args)


def _ref(pytester, rel, metric):
    return json.loads((pytester.path / rel).read_text())["metrics"][metric]["ref"]


def test_missing_baseline_passes_without_require(gated):
    result = _run(gated)
    result.assert_outcomes(passed=2)
    # (pytester adds --basetemp to the command line; a real run shows exactly what was typed)
    result.stdout.fnmatch_lines(["  no baseline for 2 cases under baselines/op/cpu/; record them with:",
                                 "    pytest --rlk-platform=cpu *--rlk-update-baselines=failed"])
    run = latest_run(gated)
    assert all(c.verdict is Verdict.MISSING_BASELINE for t in run.tests for c in t.gate.comparisons)
    assert not (gated.path / "baselines").exists()  # never written without --rlk-update-baselines


def test_missing_baseline_fails_with_require(gated):
    result = _run(gated, "--rlk-require-baselines")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*no baseline at *second-case.json (--rlk-require-baselines)*"])


def test_update_all_writes_then_pass(gated):
    _run(gated, "--rlk-update-baselines=all").assert_outcomes(passed=2)
    baseline = storage.load_baseline(gated.path / FIRST, tier="op", platform="cpu", case="test_gated.test_first")
    assert baseline.metrics["err"].band.abs_floor == 1e-5
    assert baseline.metrics["step_time_s"].ref == 1.0  # median after 1 warmup step
    assert baseline.provenance["nodeid"] == "suites/op/test_gated.py::test_first"
    result = _run(gated, "--rlk-require-baselines")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["gate: 3 pass"])


def test_regression_fails_the_test_not_teardown(gated, monkeypatch):
    _run(gated, "--rlk-update-baselines=all")
    monkeypatch.setenv("SECOND_REWARD", "0.1")  # down by 0.4 > max(0.2 * 0.5, 0.05)
    result = _run(gated)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*rlk gate failed for case 'second-case'*",
        "*reward: regression: baseline 0.5, new 0.1 (worse by 0.4 > band 0.1)*",
    ])
    report = latest_run(gated)
    failing = next(t for t in report.tests if t.case == "second-case")
    assert failing.outcome == "failed"  # the call phase failed, not teardown ("error")
    assert "reward: regression: baseline 0.5, new 0.1" in failing.failure  # kept in the run file


def test_update_failed_rewrites_only_failing_and_still_fails(gated, monkeypatch):
    _run(gated, "--rlk-update-baselines=all")
    first_before = (gated.path / FIRST).read_text()
    monkeypatch.setenv("SECOND_REWARD", "0.1")
    result = _run(gated, "--rlk-update-baselines=failed")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*baseline rewritten: *second-case.json*"])
    assert (gated.path / FIRST).read_text() == first_before
    assert _ref(gated, SECOND, "reward") == pytest.approx(0.1)
    _run(gated).assert_outcomes(passed=2)  # the rewritten baseline now holds


def test_update_all_rewrites_and_passes(gated, monkeypatch):
    _run(gated, "--rlk-update-baselines=all")
    monkeypatch.setenv("FIRST_ERR", "1e-3")
    _run(gated).assert_outcomes(passed=1, failed=1)
    _run(gated, "--rlk-update-baselines=all").assert_outcomes(passed=2)
    assert _ref(gated, FIRST, "err") == pytest.approx(1e-3)


def test_improvement_is_flagged_and_can_fail(gated, monkeypatch):
    _run(gated, "--rlk-update-baselines=all")
    monkeypatch.setenv("SECOND_REWARD", "0.9")
    result = _run(gated)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*improved (refresh the baseline): second-case/reward*"])
    _run(gated, "--rlk-fail-on-improvement").assert_outcomes(passed=1, failed=1)
    _run(gated, "--rlk-refresh-rel=1.0", "--rlk-fail-on-improvement").assert_outcomes(passed=2)


SWITCHING = """
import os

def test_bench(rlk_metrics):
    graph = os.environ.get("GATE_GRAPH") == "1"
    rlk_metrics.record("wall_ms", 5.0, unit="ms", direction="lower_is_better", space="time", gate=not graph)
    if graph:
        rlk_metrics.record("graph_ms", 1.0, unit="ms", direction="lower_is_better", space="time")
"""


def test_a_test_that_changes_what_gates_passes_and_is_re_recorded_by_failed_mode(rlk_pytester, monkeypatch):
    monkeypatch.delenv("GATE_GRAPH", raising=False)
    rlk_pytester.makepyfile(**{"suites/op/test_switch": SWITCHING})
    _run(rlk_pytester, "--rlk-update-baselines=all").assert_outcomes(passed=1)
    path = "baselines/op/cpu/test_switch.test_bench.json"
    monkeypatch.setenv("GATE_GRAPH", "1")  # the test now gates graph_ms; wall_ms is recorded, ungated
    result = _run(rlk_pytester, "--rlk-require-baselines")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*no longer gated by its test (refresh the baseline): test_switch.test_bench/wall_ms*"])
    _run(rlk_pytester, "--rlk-update-baselines=failed").assert_outcomes(passed=1)
    assert set(json.loads((rlk_pytester.path / path).read_text())["metrics"]) == {"graph_ms"}
    result = _run(rlk_pytester, "--rlk-require-baselines")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gate: 1 pass"])


def test_corrupt_baseline_names_file_and_field_once_and_in_the_summary(gated):
    _run(gated, "--rlk-update-baselines=all")
    data = json.loads((gated.path / SECOND).read_text())
    data["metrics"]["reward"]["direction"] = "upwards"
    (gated.path / SECOND).write_text(json.dumps(data))
    result = _run(gated)
    result.assert_outcomes(passed=1, failed=1)
    message = "second-case.json: field 'metrics.reward.direction'"
    result.stdout.fnmatch_lines([f"*rlk gate error: *{message}*"])
    failures = result.stdout.str().split("= FAILURES =", 1)[1].split("= rlk =", 1)[0]
    failures = failures.split("short test summary info", 1)[0]  # the one-line summary names it again
    assert failures.count(message) == 1, failures  # no chained traceback repeating it
    assert "During handling of the above exception" not in failures
    result.stdout.fnmatch_lines(["gate: 2 pass; 1 gate error:", f"  gate error: *{message}*"])
    assert message in next(t for t in latest_run(gated).tests if t.case == "second-case").gate_error


def test_unparsable_baseline_names_file(gated):
    _run(gated, "--rlk-update-baselines=all")
    (gated.path / SECOND).write_text("{truncated")
    result = _run(gated)
    result.stdout.fnmatch_lines(["*rlk gate error: *second-case.json: not valid JSON*"])


def test_wrong_schema_version_names_field(gated):
    _run(gated, "--rlk-update-baselines=all")
    data = json.loads((gated.path / FIRST).read_text())
    data["schema_version"] = 0
    (gated.path / FIRST).write_text(json.dumps(data))
    result = _run(gated)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_gated.test_first.json: field 'schema_version': is 0*"])
    _run(gated, "--rlk-update-baselines=all").assert_outcomes(passed=2)  # =all replaces it


def test_baselines_are_per_platform(gated):
    _run(gated, "--rlk-update-baselines=all")
    result = gated.runpytest("--rlk-platform=h100", "--rlk-require-baselines")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*no baseline at *baselines/op/h100/second-case.json*"])


def test_two_tests_gating_one_case_is_an_error(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_dup": """
import pytest

@pytest.mark.parametrize("i", [1, 2])
def test_dup(rlk_metrics, i):
    rlk_metrics.set_case("same")
    rlk_metrics.record("m", float(i), direction="two_sided")
"""})
    result = _run(rlk_pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*case 'same' is gated by suites/op/test_dup.py::test_dup[[]1[]] already*"])


MULTI_GPU = """
import os
import pytest

def test_one_gpu(rlk_metrics):
    rlk_metrics.record("err", 1e-6, direction="lower_is_better", space="error")

def test_decides_at_run_time(rlk_metrics):
    rlk_metrics.set_gpus(2)
    rlk_metrics.record("err", 1e-6, direction="lower_is_better", space="error")

@pytest.mark.gpus(2)
def test_two_gpus(rlk_metrics):
    rlk_metrics.record("err", float(os.environ.get("TWO_GPU_ERR", "1e-6")), direction="lower_is_better",
                       space="error", band={"abs_floor": 1e-5, "source": "test tolerance"})
"""
TWO_H200 = machine_conftest(tag="h200", detected_tag="h200", device_name="NVIDIA H200", device_count=2,
                            memory_bytes=150_000_000_000, capability="9.0")


def test_a_multi_gpu_test_keeps_its_baselines_under_tag_x_gpus(rlk_pytester, monkeypatch):
    """On a 2-GPU H200 node, a gpus(2) test gates against baselines/<tier>/h200x2/ (its figures
    depend on the two GPUs' topology) and a one-GPU test against h200/; `rlk diff` of the run
    looks in the same places, and a regression of the 2-GPU value fails both."""
    from pytest_rlk import cli

    monkeypatch.delenv("TWO_GPU_ERR", raising=False)
    rlk_pytester.makeconftest(TWO_H200)
    rlk_pytester.makepyfile(**{"suites/op/test_multi": MULTI_GPU})
    _ = rlk_pytester.runpytest("--rlk-update-baselines=all")
    base = rlk_pytester.path / "baselines" / "op"
    assert sorted(p.relative_to(base).as_posix() for p in base.rglob("*.json")) == [
        "h200/test_multi.test_one_gpu.json", "h200x2/test_multi.test_decides_at_run_time.json",
        "h200x2/test_multi.test_two_gpus.json"]
    assert json.loads((base / "h200x2/test_multi.test_two_gpus.json").read_text())["platform"] == "h200x2"
    result = rlk_pytester.runpytest("--rlk-require-baselines")
    result.assert_outcomes(passed=3)
    run = latest_run(rlk_pytester)
    assert {t.nodeid.split("::")[1]: t.baseline_platform for t in run.tests} == {
        "test_one_gpu": None, "test_decides_at_run_time": "h200x2", "test_two_gpus": "h200x2"}
    runs = str(rlk_pytester.path / ".rlk" / "runs")
    baselines = str(rlk_pytester.path / "baselines")
    assert cli.main(["--artifacts", runs, "diff", "latest", "--baselines", baselines]) == 0
    monkeypatch.setenv("TWO_GPU_ERR", "1e-3")
    result = rlk_pytester.runpytest("--rlk-require-baselines")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*baselines/op/h200x2/test_multi.test_two_gpus.json*", "  err: regression*"])
    assert cli.main(["--artifacts", runs, "diff", "latest", "--baselines", baselines]) == 1
