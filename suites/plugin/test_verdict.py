"""`rlk verdict`: runs of several platforms, each gated against its own baselines, one result and
one report (no Ray here: run files written directly; the Ray-driven nightly is in
test_nightly_ray.py)."""
from __future__ import annotations

import json

import pytest
from nightly_testing import metric, result, write_baseline, write_run

from pytest_rlk import cli, storage
from pytest_rlk.nightly.plan import NightlyPlan, NightlyRecord, NodeOutcome
from pytest_rlk.nightly.verdict import build_verdict, collect_inputs

GATED = "suites/op/test_x.py::test_speed"
PLAIN = "suites/op/test_x.py::test_parity"


@pytest.fixture
def two_platforms(tmp_path):
    """An h100 run and an h200 run, each with its own baseline for the gated test (1.0 and 2.0)."""
    baselines = tmp_path / "baselines"
    write_baseline(baselines, "h100", "test_speed", rlk_ms=1.0)
    write_baseline(baselines, "h200", "test_speed", rlk_ms=2.0)

    def run(platform: str, value: float, **kwargs):
        tests = [result(GATED, metrics=[metric("rlk_ms", value)]), result(PLAIN)]
        return write_run(tmp_path / "runs" / f"{platform}-{value}", platform, tests, **kwargs)

    return baselines, run


def verdict_of(sources, baselines, **kwargs):
    return build_verdict(collect_inputs(sources, expect=kwargs.pop("expect", None)), baselines, **kwargs)


def test_each_platform_gates_against_its_own_baselines(two_platforms, tmp_path, capsys):
    baselines, run = two_platforms
    h100, h200 = run("h100", 1.0), run("h200", 2.0)  # each equals its own platform's baseline
    verdict = verdict_of([h100, h200], baselines, expect=["h100", "h200"])
    assert verdict.passed, [p.line() for p in verdict.problems]
    assert [c.platform for c in verdict.columns] == ["h100", "h200"]
    assert all(c.gate == {"pass": 1} and c.outcomes == {"passed": 2} for c in verdict.columns)
    out = tmp_path / "verdict"
    assert cli.main(["verdict", str(h100), str(h200), "--baselines", str(baselines), "--expect", "h100,h200",
                     "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("rlk verdict: PASS; platforms expected: h100, h200")
    header = next(line for line in text.splitlines() if line.split()[:2] == ["h100", "h200"])
    assert header  # the summary has a column per platform
    report = (out / "report.md").read_text()
    assert "| nodes | node-host | node-host |" in report and "| `suites/op/test_x.py::test_speed` | passed (1 pass) | passed (1 pass) |" in report
    assert (out / "runs" / "h100-node-host" / "report.md").exists() and (out / "runs" / "h200-node-host" / "report.md").exists()
    assert json.loads((out / "verdict.json").read_text())["columns"][1]["platform"] == "h200"
    assert (out / "verdict.png").stat().st_size > 1000  # matplotlib is a dependency


def test_a_regression_on_one_platform_fails_and_is_named(two_platforms, capsys):
    baselines, run = two_platforms
    h100, h200 = run("h100", 1.0), run("h200", 1.0)  # 1.0 would pass on the h100, it is the h200's 2.0 ...
    h200_slow = run("h200", 2.5)  # ... but 2.5 is worse than the h200's own 2.0 by more than its band
    assert verdict_of([h100, h200], baselines).passed
    verdict = verdict_of([h100, h200_slow], baselines)
    assert not verdict.passed
    (problem,) = verdict.problems
    assert (problem.kind, problem.platform, problem.nodeid) == ("regression", "h200", GATED)
    assert "rlk_ms: regression: baseline 2, new 2.5" in problem.message
    assert [c.ok for c in verdict.columns] == [True, False]
    assert cli.main(["verdict", str(h100), str(h200_slow), "--baselines", str(baselines), "--no-plots",
                     "-o", str(h100.parent / "v")]) == 1
    assert f"h200 (node node-host): regression: {GATED}: rlk_ms" in capsys.readouterr().out


def test_an_expected_platform_without_a_run_is_an_error(two_platforms):
    baselines, run = two_platforms
    verdict = verdict_of([run("h100", 1.0)], baselines, expect=["h100", "h200"])
    assert [(p.kind, p.platform) for p in verdict.problems] == [("absent", "h200")]
    assert [c.platform for c in verdict.columns] == ["h100", "h200"]  # the absent one has its column


def test_failed_tests_and_unfinished_runs_fail(two_platforms):
    baselines, run = two_platforms
    crashed = write_run(run("h100", 1.0).parent / "crashed", "h100",
                        [result(PLAIN, "failed", failure="AssertionError: logp off by 0.25\nmore")],
                        status="crashed", exit_status=None)
    verdict = verdict_of([crashed, run("h200", 2.0)], baselines)
    assert sorted((p.kind, p.platform) for p in verdict.problems) == [("failed", "h100"), ("run", "h100")]
    failed = next(p for p in verdict.problems if p.kind == "failed")
    assert failed.message == "failed: AssertionError: logp off by 0.25"
    usage = write_run(run("h200", 2.0).parent / "usage", "h200", [], exit_status=4)
    assert [p.kind for p in verdict_of([usage], baselines).problems] == ["run"]


def test_improvements_missing_baselines_and_bad_baselines(two_platforms):
    baselines, run = two_platforms
    fast = run("h100", 0.5)
    verdict = verdict_of([fast], baselines)
    assert verdict.passed and "rlk_ms: improved (refresh the baseline)" in verdict.notes[0]
    assert [p.kind for p in verdict_of([fast], baselines, fail_on_improvement=True).problems] == ["improved"]
    new_platform = run("a100", 1.0)
    assert verdict_of([new_platform], baselines).passed  # no baseline: a note ...
    assert [p.kind for p in verdict_of([new_platform], baselines, require_baselines=True).problems] == ["missing_baseline"]
    storage.baseline_path(baselines, "op", "h100", "test_speed").write_text("{not json")
    (problem,) = verdict_of([run("h100", 1.0)], baselines).problems
    assert problem.kind == "baseline_error" and "not valid JSON" in problem.message


def test_a_nightly_directory_brings_its_plan_and_node_outcomes(two_platforms, tmp_path):
    baselines, run = two_platforms
    nightly = tmp_path / "nightly"
    write_run(nightly / "nodes" / "h100-a" / "runs" / "r1", "h100", [result(GATED, metrics=[metric("rlk_ms", 1.0)])])
    write_run(nightly / "nodes" / "h200-a" / "runs" / "r2", "h100", [result(PLAIN)], status="crashed")
    plan = NightlyPlan.model_validate({"schema_version": 1, "nodes": [
        {"name": "h100-a", "resources": {"h100": 1}, "platform": "h100"},
        {"name": "h200-a", "resources": {"h200": 1}, "platform": "h200"},
        {"name": "gb200-a", "resources": {"gb200": 1}, "platform": "gb200"}]})
    record = NightlyRecord(plan=plan, started_utc="t", nodes={
        "h100-a": NodeOutcome(name="h100-a", platform="h100", status="completed", exit_status=0,
                              run_dir="nodes/h100-a/runs/r1"),
        "h200-a": NodeOutcome(name="h200-a", platform="h200", status="died", detail="NodeDiedError: gone",
                              run_dir="nodes/h200-a/runs/r2")})
    storage.write_json_atomic(nightly / "nightly.json", record)
    verdict = verdict_of([nightly], baselines)
    lines = sorted(p.line() for p in verdict.problems)
    assert lines == [
        "gb200 (node gb200-a): node: no_answer: the nightly recorded nothing for this node (did its driver "
        "stop early?); no run files arrived",
        "gb200: absent: expected, but no run of this platform was given (its node produced none)",
        "h100 (node h200-a): platform_mismatch: the plan expects platform 'h200' on this node; its run reports "
        "'h100' (cpu, 0 GPUs)",
        "h200 (node h200-a): node: died: NodeDiedError: gone; partial run kept: nodes/h200-a/runs/r2 "
        "(crashed, 1 test)",
        "h200: absent: expected, but no run of this platform was given (its node produced none)",
    ]
