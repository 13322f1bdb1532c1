"""The ``rlk`` terminal section's lines (pytest_rlk.table): the slowest tests, the refresh command."""
from __future__ import annotations

from pytest_rlk.schema import PlatformInfo, RunManifest, RunRecord, TestRecord
from pytest_rlk.table import slowest_lines, summary_lines


def _run(started: str, finished: str | None, durations: list[float]) -> RunRecord:
    manifest = RunManifest(run_id="r", created_utc=started, argv=[], tiers=["op"], software={},
                           platform=PlatformInfo(tag="cpu", detected_tag="cpu"))
    tests = [TestRecord(nodeid=f"suites/op/test_t.py::test_{i}", case=f"c{i}", tier="op", outcome="passed",
                        duration_s=d) for i, d in enumerate(durations)]
    return RunRecord(manifest=manifest, status="complete" if finished else "running",
                     finished_utc=finished, tests=tests)


def test_slowest_five_listed_after_a_minute(tmp_path):
    run = _run("2026-11-22T08:00:00.000000Z", "2026-11-22T08:01:30.500000Z", [1, 30, 2, 25, 3, 4, 0.5])
    elapsed_s = 90  # 08:00:00 to 08:01:30.5, whole seconds
    lines = slowest_lines(run)
    assert lines[0] == f"slowest 5 tests (whole run {elapsed_s} s):"
    assert [line.split()[-1].rsplit("_", 1)[1] for line in lines[1:]] == ["1", "3", "5", "4", "2"]
    assert lines[1] == "     30.0 s  suites/op/test_t.py::test_1"
    assert lines[0] in summary_lines(run, tmp_path, ["op"])


def test_short_or_unfinished_sessions_list_nothing():
    assert slowest_lines(_run("2026-11-22T08:00:00.000000Z", "2026-11-22T08:00:59.000000Z", [50.0])) == []
    assert slowest_lines(_run("2026-11-22T08:00:00.000000Z", None, [500.0])) == []


def test_refresh_lines_name_the_cases_a_refresh_rewrites_and_leave_out_the_rest(tmp_path):
    from pytest_rlk.schema import GateResult, MetricComparison, Verdict
    from pytest_rlk.table import refresh_lines

    def gated(case, verdict, outcome="passed", injected=None, written=False):
        return TestRecord(nodeid=f"suites/op/test_t.py::{case}", case=case, tier="op", outcome=outcome,
                          injected_fault=injected, gate=GateResult(case=case, baseline_written=written, comparisons=[
                              MetricComparison(name="m", verdict=verdict)]))

    run = _run("2026-12-07T16:00:00Z", "2026-12-07T16:01:00Z", [])
    run.tests = [gated("a", Verdict.UNGATED), gated("b", Verdict.IMPROVED), gated("c", Verdict.PASS),
                 gated("d", Verdict.IMPROVED, outcome="failed"), gated("e", Verdict.IMPROVED, injected="bias"),
                 gated("f", Verdict.UNGATED, written=True)]
    assert refresh_lines(run, tmp_path / "my run") == [
        "refresh 1 baseline from this run (improved: every metric of these cases from this run):",
        f"  rlk baselines update '{tmp_path}/my run' --mode all --case b",
        "refresh 1 baseline from this run (metrics no longer gated dropped, the references that pass kept):",
        f"  rlk baselines update '{tmp_path}/my run' --case a"]
