"""The ``rlk`` terminal section's slowest-tests lines (pytest_rlk.table), without a pytest run."""
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
