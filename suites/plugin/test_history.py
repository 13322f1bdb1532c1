"""Baselines with history (pytest_rlk.history): bands recommended from runs, distrust, shadow mode.

The plain-module tests build run records directly; the pytester tests run the real plugin and the
real ``rlk`` entry point on a tiny gated test whose value comes from the environment.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rlk_plugin_testing import latest_run_dir
from test_cli import rlk

from pytest_rlk import storage
from pytest_rlk.bands import NOISE_RULE
from pytest_rlk.compare import compare_to_baseline, shadow_reason
from pytest_rlk.history import HistoryError, case_history, distrust, recommend, write_recommendations
from pytest_rlk.schema import (
    BASELINE_SCHEMA_VERSION,
    Band,
    MetricRecord,
    PlatformInfo,
    RunManifest,
    RunRecord,
    TestRecord,
    Verdict,
)

BASELINES = Path(__file__).resolve().parents[2] / "baselines"
COMMITTED = sorted(BASELINES.glob("*/*/*.json"))


def make_run(run_id: str, values: dict[str, float], *, platform: str = "h200", day: int = 1,
             outcome: str = "passed", failure: str | None = None) -> tuple[Path, RunRecord]:
    tests = [TestRecord(nodeid=f"suites/op/test_x.py::{case}", case=case, tier="op", outcome=outcome,
                        failure=failure, metrics=[MetricRecord(
                            name="step_ms", value=value, unit="ms", direction="lower_is_better", space="time")])
             for case, value in values.items()]
    manifest = RunManifest(run_id=run_id, created_utc=f"2026-12-0{day}T00:00:00Z", argv=[], tiers=["op"],
                           platform=PlatformInfo(tag=platform, detected_tag=platform), software={},
                           suite_commit=f"{day:040d}")
    return Path(run_id) / "run.json", RunRecord(manifest=manifest, status="complete", tests=tests)


THREE = [make_run("r1", {"a": 1.00, "b": 5.0}, day=1), make_run("r2", {"a": 1.02, "b": 5.0}, day=2),
         make_run("r3", {"a": 0.98, "b": 5.0}, day=3)]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(BASELINES)))
def test_every_committed_baseline_loads_as_a_history(path):
    baseline = storage.load_baseline(path)
    hist = case_history(baseline)
    if baseline.history is None:  # a version-1 file: unchanged, one run (its recording's)
        assert baseline.schema_version == 1 and hist.legacy and len(hist.runs) == 1
        assert {name: mh.values[hist.runs[0].run_id] for name, mh in hist.metrics.items()} == {
            name: m.ref for name, m in baseline.metrics.items()}
    assert shadow_reason(baseline) is None  # committed baselines gate


def test_recommend_gives_stats_and_the_rule_band_naming_its_runs(tmp_path):
    recs = {r.case: r for r in recommend(THREE, tmp_path)}
    a = recs["a"].metrics[0]
    assert a.stats.n == 3 and a.stats.mean == pytest.approx(1.0) and a.stats.sd == pytest.approx(0.02)
    assert (a.stats.min, a.stats.max) == (0.98, 1.02)
    assert a.width == pytest.approx(NOISE_RULE.k * 0.02)  # 4 sd = 0.08 > 5% of the mean
    b = recs["b"].metrics[0]
    assert b.stats.sd == 0.0 and b.width == pytest.approx(NOISE_RULE.rel * 5.0)  # runs agreed: 5% floor
    assert a.band.rests_on == 3
    for text in ("3 runs", "r1 (2026-12-01, 0000000000)", "r3 (2026-12-03", NOISE_RULE.describe()):
        assert text in a.band.source
    write_recommendations(recs.values())
    written = storage.load_baseline(tmp_path / "op" / "h200" / "a.json")
    assert written.schema_version == BASELINE_SCHEMA_VERSION
    assert written.metrics["step_ms"].ref == pytest.approx(1.0)
    assert list(written.history.metrics["step_ms"].values) == ["r1", "r2", "r3"]
    assert shadow_reason(written) is None


@pytest.mark.parametrize(("runs", "message"), [
    (THREE[:2], r"2 runs given: a band rests on at least 3 runs"),
    ([*THREE[:2], make_run("r4", {"a": 1.0, "b": 5.0}, platform="h100")],
     r"2 platforms \(r1: h200, r2: h200, r4: h100\)"),
    ([*THREE[:2], make_run("r4", {"a": math.inf, "b": 5.0})], r"run r4: case a: metric step_ms is inf: a non-finite"),
    ([*THREE[:2], make_run("r4", {"a": 1.0})], r"case b .* not in r4: give runs of the same cases"),
    ([*THREE[:2], THREE[0]], r"run r1 given more than once"),
    ([*THREE[:2], make_run("r4", {"a": 1.0, "b": 5.0}, outcome="failed", failure="AssertionError: x")],
     r"run r4: test suites/op/test_x.py::a failed \(AssertionError: x\)"),
])
def test_recommend_refuses_runs_that_cannot_make_a_band(tmp_path, runs, message):
    with pytest.raises(HistoryError, match=message):
        recommend(runs, tmp_path)


def test_a_run_that_failed_by_its_gate_alone_measures_noise(tmp_path):
    failed = make_run("r4", {"a": 1.0, "b": 5.0}, outcome="failed", failure="rlk gate failed for case 'a'")
    assert recommend([*THREE[:2], failed], tmp_path)


def test_distrust_recommends_again_from_the_runs_left_and_shadows_below_three(tmp_path):
    write_recommendations(recommend([*THREE, make_run("r4", {"a": 1.2, "b": 5.0}, day=4)], tmp_path))
    path = tmp_path / "op" / "h200" / "a.json"
    assert storage.load_baseline(path).metrics["step_ms"].band.rests_on == 4
    changed = distrust("r4", tmp_path)
    assert [d.shadow for d in changed] == [False, False]
    after = storage.load_baseline(path)
    assert after.metrics["step_ms"].ref == pytest.approx(1.0) and after.metrics["step_ms"].band.rests_on == 3
    assert [r.run_id for r in after.history.distrusted] == ["r4"]
    assert "r4" not in after.history.metrics["step_ms"].values
    assert "r4" not in after.metrics["step_ms"].band.source
    assert all(d.shadow for d in distrust("r1", tmp_path))
    assert "rest on 2 trusted runs" in shadow_reason(storage.load_baseline(path))
    with pytest.raises(HistoryError, match="run r1 is in no baseline's history"):
        distrust("r1", tmp_path)


def test_distrusting_a_legacy_baselines_only_run_leaves_it_with_no_history_in_shadow(tmp_path):
    legacy = tmp_path / "module" / "cpu" / "c.json"
    legacy.parent.mkdir(parents=True)
    legacy.write_text(json.dumps({
        "schema_version": 1, "tier": "module", "case": "c", "platform": "cpu",
        "provenance": {"run_id": "old", "created_utc": "2026-11-01T00:00:00Z", "suite_commit": "abc"},
        "metrics": {"err": {"ref": 1e-6, "direction": "lower_is_better", "space": "error",
                            "band": {"abs_floor": 1e-4, "source": "tolerance"}}}}))
    assert shadow_reason(storage.load_baseline(legacy)) is None
    [d] = distrust("old", tmp_path)
    assert d.shadow
    after = storage.load_baseline(legacy)
    assert after.metrics["err"].band.rests_on == 0 and after.history.runs == []
    record = TestRecord(nodeid="n", case="c", tier="module", outcome="passed", metrics=[
        MetricRecord(name="err", value=1.0, direction="lower_is_better", space="error")])
    result = compare_to_baseline(record, after)
    assert result.shadow and result.regressions and not result.failed()
    nan = record.model_copy(update={"metrics": [MetricRecord(name="err", value=math.nan, direction="lower_is_better",
                                                             space="error", allow_nonfinite=True)]})
    nan_result = compare_to_baseline(nan, after)
    assert nan_result.failed() and "not finite" in nan_result.regressions[0].detail  # an error in shadow too


GATED = """
import os

def test_gated(rlk_metrics):
    rlk_metrics.record("loss", float(os.environ["RLK_LOSS"]), direction="lower_is_better", space="loss")
"""


def test_recommended_bands_gate_a_fourth_run_and_rlk_diff_names_their_runs(rlk_pytester, monkeypatch):
    rlk_pytester.makepyfile(**{"suites/op/test_gated": GATED})
    runs = []
    for value in ("1.00", "1.01", "0.99"):
        monkeypatch.setenv("RLK_LOSS", value)
        rlk_pytester.runpytest("--rlk-platform=cpu").assert_outcomes(passed=1)
        runs.append(latest_run_dir(rlk_pytester))
    done = rlk("baselines", "recommend", *map(str, runs), cwd=rlk_pytester.path)
    assert done.returncode == 0, done.stderr
    assert "test_gated.test_gated/loss" in done.stdout and "wrote 1 baselines" in done.stdout
    monkeypatch.setenv("RLK_LOSS", "1.02")  # within 4 sd (0.04) of the mean
    rlk_pytester.runpytest("--rlk-platform=cpu").assert_outcomes(passed=1)
    diff = rlk("diff", "latest", cwd=rlk_pytester.path)
    assert diff.returncode == 0, diff.stdout
    assert f"band source: test_gated.test_gated: loss: 3 runs: {runs[0].name}" in diff.stdout
    monkeypatch.setenv("RLK_LOSS", "1.10")
    rlk_pytester.runpytest("--rlk-platform=cpu").assert_outcomes(failed=1)

    too_few = rlk("baselines", "recommend", *map(str, runs[:2]), cwd=rlk_pytester.path)
    assert too_few.returncode == 2 and "2 runs given" in too_few.stderr

    # distrusting one of the three runs leaves two: the case gates in shadow mode
    done = rlk("baselines", "distrust", runs[0].name, cwd=rlk_pytester.path)
    assert done.returncode == 0 and "1 now in shadow mode" in done.stdout, done.stdout + done.stderr
    result = rlk_pytester.runpytest("--rlk-platform=cpu")
    result.assert_outcomes(passed=1)  # 1.10 regresses, and the exit is unaffected
    assert result.ret == 0
    result.stdout.fnmatch_lines(["shadow mode: 1 case*",
                                 "  shadow: test_gated.test_gated: would fail: loss regression (bands rest on 2*"])
    diff = rlk("diff", "latest", cwd=rlk_pytester.path)
    assert diff.returncode == 0 and "shadow: test_gated.test_gated: would fail" in diff.stdout


def test_update_baselines_writes_a_one_run_history_that_gates(rlk_pytester, monkeypatch):
    """What --rlk-update-baselines writes gates from its first run (stated bands), as CI's CPU
    baselines must: shadow mode is for bands resting on too few measured runs."""
    rlk_pytester.makepyfile(**{"suites/op/test_gated": GATED})
    monkeypatch.setenv("RLK_LOSS", "1.0")
    rlk_pytester.runpytest("--rlk-platform=cpu", "--rlk-update-baselines=all").assert_outcomes(passed=1)
    [path] = (rlk_pytester.path / "baselines").rglob("*.json")
    baseline = storage.load_baseline(path)
    assert baseline.schema_version == BASELINE_SCHEMA_VERSION and len(baseline.history.runs) == 1
    assert baseline.metrics["loss"].band.rests_on is None and shadow_reason(baseline) is None
    monkeypatch.setenv("RLK_LOSS", "1.05")
    result = rlk_pytester.runpytest("--rlk-platform=cpu")
    result.assert_outcomes(failed=1)
    assert [c.verdict for c in storage.load_run(storage.resolve_run_file(
        "latest", rlk_pytester.path / ".rlk" / "runs")).tests[0].gate.comparisons] == [Verdict.REGRESSION]


def test_a_failed_mode_rewrite_keeps_the_history_of_the_metrics_it_keeps():
    from pytest_rlk.history import one_run_history

    [rec] = [r for r in recommend(THREE, Path("unused")) if r.case == "a"]
    old = rec.baseline
    kept = old.metrics["step_ms"]
    fresh = kept.model_copy(update={"ref": 2.0, "band": Band(rel=0.15)})
    prov = {"run_id": "r9", "created_utc": "2026-12-09T00:00:00Z", "suite_commit": "c9"}
    hist = one_run_history(prov, {"step_ms": kept, "new_ms": fresh}, old)
    assert list(hist.metrics["step_ms"].values) == ["r1", "r2", "r3"]
    assert hist.metrics["new_ms"].values == {"r9": 2.0}
    assert [r.run_id for r in hist.runs] == ["r1", "r2", "r3", "r9"]


def test_the_report_verdict_of_a_shadow_case_passes_unless_a_value_is_not_finite():
    from pytest_rlk.report import verdict_of
    from pytest_rlk.schema import GateResult, MetricComparison

    regression = MetricComparison(name="m", baseline=1.0, new=2.0, verdict=Verdict.REGRESSION, detail="worse")
    _, run = make_run("r", {"a": 1.0})
    run.tests[0].gate = GateResult(case="a", comparisons=[regression], shadow="bands rest on 2 trusted runs")
    assert verdict_of(run)[0] == "PASS"
    run.tests[0].gate.comparisons.append(MetricComparison(name="n", baseline=1.0, new=None, verdict=Verdict.REGRESSION,
                                                          detail="value is not finite (nan)"))
    assert verdict_of(run)[0] == "FAIL"
