"""The nightly plan's schema, and a node's pytest job run here without Ray (files sent as the run
grows, a timeout that stops pytest and keeps its partial run)."""
from __future__ import annotations

import io
import json
import os
import signal
import tarfile

import pytest
from rlk_plugin_testing import checkout_pythonpath

from pytest_rlk import cli, storage
from pytest_rlk.nightly.node_job import FileSync, NodeJob, run_node_job, unpack_files
from pytest_rlk.nightly.plan import NightlyPlan, load_plan

NODE = {"name": "h100-a", "resources": {"h100": 1}, "platform": "h100"}


def plan(**node) -> dict:
    return {"schema_version": 1, "nodes": [{**NODE, **node}]}


def test_plan_becomes_each_nodes_pytest_arguments(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"schema_version": 1, "name": "nightly", "nodes": [
        {**NODE, "tiers": ["op", "module"], "markers": "gpu or h100", "shard_gpus": True,
         "pytest_args": ["--rlk-require-baselines"]},
        {"name": "h200-a", "resources": {"h200": 1}, "platform": "h200"}]}))
    loaded = load_plan(path)
    assert loaded.expected_platforms == ["h100", "h200"]
    assert loaded.nodes[0].pytest_argv() == ["-p", "no:cacheprovider", "--rlk-tier=op,module", "-m", "gpu or h100",
                                             "-n", "auto", "--rlk-shard-gpus", "--rlk-require-baselines"]
    assert loaded.nodes[1].pytest_argv() == ["-p", "no:cacheprovider", "--rlk-tier=op"]


@pytest.mark.parametrize("change, field, message", [
    ({"name": "a/b"}, "nodes.0.name", "names a directory"),
    ({"resources": {}}, "nodes.0.resources", "name the node kind's Ray resource"),
    ({"resources": {"h100": 0}}, "nodes.0.resources", "'h100' must be > 0"),
    ({"platform": "H100!"}, "nodes.0.platform", "is not a platform tag"),
    ({"tiers": ["ops"]}, "nodes.0.tiers", "unknown tier 'ops'"),
    ({"pytest_args": ["--rlk-artifacts=/x"]}, "nodes.0.pytest_args", "the node job sets it"),
    ({"pytest_args": ["-n4"]}, "nodes.0.pytest_args", "use the node's 'shard_gpus'"),
    ({"pytest_args": ["-m", "gpu"]}, "nodes.0.pytest_args", "use the node's 'markers'"),
    ({"timeout_s": 0}, "nodes.0.timeout_s", "greater than 0"),
    ({"gpus": 8}, "nodes.0.gpus", "Extra inputs are not permitted"),
])
def test_bad_plans_name_the_field(tmp_path, change, field, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan(**change)))
    with pytest.raises(storage.RlkFileError) as exc:
        load_plan(path)
    assert exc.value.field == field and message in str(exc.value)


def test_duplicate_node_names_are_refused():
    with pytest.raises(ValueError, match="node names must be unique: h100-a"):
        NightlyPlan.model_validate({"schema_version": 1, "nodes": [NODE, NODE]})


def test_no_cluster_is_a_usage_error_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    pytest.importorskip("ray", reason="rlk nightly runs its node jobs through Ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where `auto` looks for a cluster started here: none
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan()))
    out = tmp_path / "nightly"
    assert cli.main(["nightly", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "rlk: error: no Ray cluster at address 'auto'" in err and "--address or RAY_ADDRESS" in err
    assert not out.exists()


def test_file_sync_sends_new_and_changed_files_only(tmp_path):
    root, dest = tmp_path / "node", tmp_path / "driver"
    (root / "runs" / "r1" / "parts").mkdir(parents=True)
    (root / "runs" / "r1" / "parts" / "main.json").write_text("1")
    (root / "runs" / "r1" / "parts" / ".main.json.x.tmp").write_text("half")  # an atomic writer's temp
    (root / "runs" / "latest").symlink_to("r1")
    sync = FileSync(root)
    assert unpack_files(sync.changed(), dest) == ["runs/r1/parts/main.json"]
    assert sync.changed() is None
    (root / "runs" / "r1" / "parts" / "main.json").write_text("22")
    (root / "pytest.log").write_text("log")
    assert sorted(unpack_files(sync.changed(), dest)) == ["pytest.log", "runs/r1/parts/main.json"]
    assert (dest / "runs" / "r1" / "parts" / "main.json").read_text() == "22"


def test_unpack_refuses_paths_outside_the_node_dir(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="refusing archive member '../escape.txt'"):
        unpack_files(buf.getvalue(), tmp_path / "dest")
    assert not (tmp_path / "escape.txt").exists()


TINY_SUITE = {
    "conftest": 'pytest_plugins = ["pytest_rlk.plugin"]\n',
    "suites/op/test_tiny": """
import os, time

def test_a(rlk_metrics):
    rlk_metrics.record("value", 1.0, direction="lower_is_better")

def test_b():
    pass

def test_c_waits():
    time.sleep(float(os.environ.get("TINY_SLEEP", "0")))
""",
}


def _job_messages(pytester, monkeypatch, **job):
    pytester.makepyfile(**TINY_SUITE)
    monkeypatch.setenv("PYTHONPATH", checkout_pythonpath(os.environ.get("PYTHONPATH")))
    node = NodeJob(name="n1", pytest_args=["-p", "no:cacheprovider"], suite_root=str(pytester.path), **job)
    work = pytester.path / "work"
    work.mkdir()
    dest = pytester.path / "received"
    messages = []
    for message in run_node_job(node, work_dir=work):
        if message["kind"] == "files":
            unpack_files(message["tar"], dest)
        messages.append(message)
    return messages, dest


def test_node_job_runs_pytest_and_sends_its_run(pytester, monkeypatch):
    messages, dest = _job_messages(pytester, monkeypatch, sync_interval_s=0.2)
    assert messages[0]["kind"] == "started" and messages[0]["argv"][-1].startswith("--rlk-artifacts=")
    final = messages[-1]
    assert final["kind"] == "finished" and final["exit_status"] == 0 and not final["timed_out"]
    run = storage.load_run(dest / final["run_dir"] / "run.json")
    assert run.status == "complete" and [t.outcome for t in run.tests] == ["passed"] * 3
    assert "3 passed" in (dest / "pytest.log").read_text()


@pytest.mark.parametrize("caller_sigint", ["default", "ignored"])
def test_node_job_timeout_stops_pytest_and_keeps_the_partial_run(pytester, monkeypatch, caller_sigint):
    """``ignored``: the driver itself was started as ``cmd &`` by a shell without job control (cron,
    nohup, a CI script), which leaves SIGINT ignored in it and, through exec, in its children."""
    monkeypatch.setenv("TINY_SLEEP", "60")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if caller_sigint == "ignored" else None
    try:
        messages, dest = _job_messages(pytester, monkeypatch, timeout_s=10.0, sync_interval_s=0.5, stop_grace_s=10.0)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    final = messages[-1]
    assert final["kind"] == "finished" and final["timed_out"]
    run = storage.load_run(dest / final["run_dir"] / "run.json")
    assert run.status == "interrupted"  # Ctrl-C first: pytest ended its run itself
    assert [t.nodeid.split("::")[1] for t in run.tests] == ["test_a", "test_b"]
    # the files had arrived before the end too: a node that dies keeps what it sent
    assert sum(m["kind"] == "files" for m in messages) >= 2
