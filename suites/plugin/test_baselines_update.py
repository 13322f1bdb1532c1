"""`rlk baselines update RUN`: a recorded run's tests written to the baselines as
`--rlk-update-baselines` writes them, without running them again (pytest_rlk.gate.update_from_run)."""
from __future__ import annotations

import json
import shlex

import pytest
from rlk_plugin_testing import latest_run_dir
from test_cli import rlk
from test_history import GATED

from pytest_rlk import storage
from pytest_rlk.gate import UpdateError, update_from_run
from pytest_rlk.schema import MetricRecord, PlatformInfo, RunManifest, RunRecord, TestRecord, Verdict


def _metric(name: str, value: float, *, gate: bool = True) -> MetricRecord:
    return MetricRecord(name=name, value=value, unit="ms", direction="lower_is_better", space="time", gate=gate)


def _run(*tests: TestRecord, status: str = "complete") -> RunRecord:
    manifest = RunManifest(run_id="20261207T163645Z-abcdef", created_utc="2026-12-07T16:36:45Z", argv=[],
                           tiers=["module"], platform=PlatformInfo(tag="h100", detected_tag="h100"), software={},
                           suite_commit="e3d7110" + "0" * 33)
    return RunRecord(manifest=manifest, status=status, tests=list(tests), collected=len(tests) + 1)


def _test(case: str, *metrics: MetricRecord, outcome: str = "passed", injected: str | None = None) -> TestRecord:
    return TestRecord(nodeid=f"suites/module/test_x.py::{case}", case=case, tier="module", outcome=outcome,
                      metrics=list(metrics), injected_fault=injected)


def test_failed_mode_drops_metrics_no_longer_gated_and_keeps_references_that_pass(tmp_path):
    """The refresh a GPU run asks for ("no longer gated by its test"), made from that run's file."""
    first = _run(_test("step", _metric("loss_ms", 2.0), _metric("step_ms", 20.0)))
    update_from_run(first, tmp_path, mode="all")
    later = _run(_test("step", _metric("loss_ms", 2.05), _metric("step_ms", 25.0, gate=False)))
    [outcome] = update_from_run(later, tmp_path, mode="failed")
    assert outcome.result.baseline_written and outcome.failure is None
    assert {c.name: c.verdict for c in outcome.result.comparisons}["step_ms"] is Verdict.UNGATED
    baseline = storage.load_baseline(tmp_path / "module" / "h100" / "step.json")
    assert set(baseline.metrics) == {"loss_ms"} and baseline.metrics["loss_ms"].ref == 2.0  # within its band: kept
    assert baseline.provenance["run_id"] == later.manifest.run_id
    assert baseline.provenance["suite_commit"] == later.manifest.suite_commit
    assert baseline.provenance["platform"]["tag"] == "h100"


def test_only_the_cases_asked_for_are_written(tmp_path):
    run = _run(_test("a-dense", _metric("m", 1.0)), _test("a-moe", _metric("m", 1.0)), _test("b", _metric("m", 1.0)),
               _test("ungated", _metric("m", 1.0, gate=False)))
    written = update_from_run(run, tmp_path, mode="all", cases=["a-*"])
    assert sorted(o.result.baseline_path.rsplit("/", 1)[-1] for o in written) == ["a-dense.json", "a-moe.json"]
    assert sorted(p.name for p in (tmp_path / "module" / "h100").iterdir()) == ["a-dense.json", "a-moe.json"]
    by_nodeid = update_from_run(run, tmp_path, mode="all", cases=["suites/module/test_x.py::b"])
    assert len(by_nodeid) == 1


@pytest.mark.parametrize(("run", "cases", "mode", "message"), [
    (_run(_test("a", _metric("m", 1.0))), ["nope*"], "all", "no gated test of run 20261207T163645Z-abcdef matches 'nope\\*'"),
    (_run(_test("a", _metric("m", 1.0), outcome="failed")), [], "all", r"suites/module/test_x.py::a \(failed\)"),
    (_run(_test("a", _metric("m", 1.0), injected="logp bias")), [], "all", r"injected fault: logp bias"),
    (_run(_test("a", _metric("m", 1.0))), [], "some", "unknown mode 'some'; valid modes: failed, all"),
], ids=["unmatched-glob", "failed-test", "injected-fault", "bad-mode"])
def test_a_run_that_cannot_write_what_is_asked_is_refused_naming_it(tmp_path, run, cases, mode, message):
    with pytest.raises(UpdateError, match=message):
        update_from_run(run, tmp_path, mode=mode, cases=cases)
    assert not tmp_path.joinpath("module").exists()


def test_the_command_writes_what_the_plugin_writes(rlk_pytester, monkeypatch):
    """The same run written twice: by `--rlk-update-baselines=all` during the run, and afterwards
    by `rlk baselines update RUN --mode all` into another directory: the same file."""
    rlk_pytester.makepyfile(**{"suites/op/test_gated": GATED})
    monkeypatch.setenv("RLK_LOSS", "1.0")
    rlk_pytester.runpytest("--rlk-platform=cpu", "--rlk-update-baselines=all").assert_outcomes(passed=1)
    run_dir = latest_run_dir(rlk_pytester)
    done = rlk("baselines", "update", str(run_dir), "--mode", "all", "--baselines", "again", cwd=rlk_pytester.path)
    assert done.returncode == 0, done.stderr
    assert "1 of 1 baselines written (--mode all)" in done.stdout
    [by_plugin] = (rlk_pytester.path / "baselines").rglob("*.json")
    by_command = rlk_pytester.path / "again" / by_plugin.relative_to(rlk_pytester.path / "baselines")
    assert json.loads(by_command.read_text()) == json.loads(by_plugin.read_text())

    bad = rlk("baselines", "update", str(run_dir), "--case", "missing", cwd=rlk_pytester.path)
    assert bad.returncode == 2 and "matches 'missing'" in bad.stderr


def test_a_partial_run_writes_the_tests_it_recorded_and_says_so(rlk_pytester, tmp_path):
    run = _run(_test("a", _metric("m", 1.0)), status="interrupted")
    run_dir = tmp_path / "runs" / run.manifest.run_id
    storage.write_run(run_dir, run)
    done = rlk("baselines", "update", str(run_dir), "--baselines", str(tmp_path / "b"), cwd=rlk_pytester.path)
    assert done.returncode == 0, done.stderr
    assert "interrupted: partial, 1 of 2 tests recorded: only the tests it recorded are written" in done.stdout
    assert "wrote " in done.stdout and (tmp_path / "b" / "module" / "h100" / "a.json").exists()


def test_the_summary_prints_the_command_that_refreshes_what_it_calls_out_of_date(rlk_pytester, monkeypatch):
    """A value better than its baseline beyond the refresh band: the summary says so and prints
    the `rlk baselines update` command, which, run as printed, leaves the next run's gate clean."""
    rlk_pytester.makepyfile(**{"suites/op/test_gated": GATED})
    monkeypatch.setenv("RLK_LOSS", "1.0")
    rlk_pytester.runpytest("--rlk-platform=cpu", "--rlk-update-baselines=all").assert_outcomes(passed=1)
    monkeypatch.setenv("RLK_LOSS", "0.5")  # lower is better: improved, far past the band
    result = rlk_pytester.runpytest("--rlk-platform=cpu")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["refresh 1 baseline from this run (improved: every metric of these cases from this run):",
                                 "  rlk baselines update * --mode all --case test_gated.test_gated"])
    command = next(line for line in result.stdout.lines if line.startswith("  rlk baselines update "))
    done = rlk(*shlex.split(command)[1:], cwd=rlk_pytester.path)
    assert done.returncode == 0 and "1 of 1 baselines written (--mode all)" in done.stdout, done.stderr
    again = rlk_pytester.runpytest("--rlk-platform=cpu")
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines(["gate: 1 pass"])
    assert not [line for line in again.stdout.lines if line.startswith("refresh ")]
