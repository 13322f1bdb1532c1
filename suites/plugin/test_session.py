"""Unit tests of part files and the merge (pytest_rlk.session) without a pytest run."""
from __future__ import annotations

import subprocess
import sys

from pytest_rlk import session, storage
from pytest_rlk.manifest import build_manifest, new_run_id
from pytest_rlk.platform import detect
from pytest_rlk.schema import MetricRecord, TestRecord


def _start(tmp_path):
    manifest = build_manifest(run_id=new_run_id(), argv=["-q"], tiers=["op"], platform=detect("cpu"),
                              suite_root=tmp_path, vime_root=None, backend_option=None)
    return session.start_run(tmp_path / "runs", manifest)


def _test(nodeid, value):
    return TestRecord(nodeid=nodeid, case=nodeid, outcome="passed",
                      metrics=[MetricRecord(name="m", value=value, direction="two_sided")])


def test_parts_merge_and_are_idempotent(tmp_path):
    run_dir = _start(tmp_path)
    for worker, value in (("gw0", 1.0), ("gw1", 2.0)):
        writer = session.PartWriter(run_dir, worker)
        writer.set_deselected({"e2e": 3})
        writer.add(_test(f"t{worker}", value))
    first = session.merge_run(run_dir, status="complete", exit_status=0)
    again = session.merge_run(run_dir)
    assert first.status == again.status == "complete"
    assert sorted(t.metrics[0].value for t in again.tests) == [1.0, 2.0]
    assert again.deselected == {"e2e": 3}  # the same collection seen by both workers
    assert (tmp_path / "runs" / "latest").resolve() == run_dir.resolve()


def test_the_collected_count_adds_the_all_gpu_phase_to_the_workers(tmp_path):
    """Each xdist worker collects the tests less those held back for the all-GPU phase, which
    collects exactly those: a partial run reads "N of (workers' count + held back)"."""
    run_dir = _start(tmp_path)
    for worker, collected in (("gw0", 10), ("gw1", 10), (session.ALL_GPU_WORKER, 3)):
        writer = session.PartWriter(run_dir, worker)
        writer.set_collected(collected)
        writer.add(_test(f"t{worker}", 1.0))
    run = session.merge_run(run_dir, status="interrupted", exit_status=2)
    assert run.collected == 13
    assert run.describe_status() == "interrupted: partial, 3 of 13 tests recorded"


def test_running_run_of_a_live_controller_is_not_called_crashed(tmp_path):
    run_dir = _start(tmp_path)  # this process is the controller, and it is alive
    assert session.merge_run(run_dir).status == "running"
    header = storage.load_run(run_dir / "run.json")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    storage.write_run(run_dir, header.model_copy(update={"pid": int(dead.stdout)}))
    assert session.merge_run(run_dir).status == "crashed"


def test_latest_moves_only_when_a_run_records_a_result(tmp_path):
    first = _start(tmp_path)
    session.PartWriter(first, "main").add(_test("t1", 1.0))
    assert (tmp_path / "runs" / "latest").resolve() == first.resolve()
    empty = _start(tmp_path)  # selected nothing, or stopped before its first test
    session.PartWriter(empty, "main").flush()
    session.merge_run(empty, status="complete", exit_status=5)
    assert (tmp_path / "runs" / "latest").resolve() == first.resolve()
    second = _start(tmp_path)
    session.PartWriter(second, "gw0").add(_test("t2", 2.0))
    assert (tmp_path / "runs" / "latest").resolve() == second.resolve()
