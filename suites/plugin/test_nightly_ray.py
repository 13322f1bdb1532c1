"""`rlk nightly` through a real local Ray cluster: a head and logical nodes on this machine, each
with the custom resource of a node kind ({"kind_a": 1}, ...), every service on 127.0.0.1. Each
node runs a tiny real pytest job; the verdict merges their runs.

The cluster is ray.cluster_utils.Cluster, started and shut down here (its processes only)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
from nightly_testing import write_baseline

from pytest_rlk import cli, storage
from pytest_rlk.e2e.ray_head import RAY_LOOPBACK_ENV

pytest.importorskip("ray", reason="rlk nightly runs its node jobs through Ray")
from ray.cluster_utils import Cluster  # noqa: E402

KINDS = ("kind_a", "kind_b", "kind_c")
NODE_ARGS = {"num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 * 1024 * 1024}
TINY_TESTS = """
import os, time

def test_value(rlk_metrics):
    rlk_metrics.record("value", float(os.environ.get("TINY_VALUE", "1.0")), direction="lower_is_better",
                       band={"abs_floor": 0.1, "source": "tiny"})

def test_plain():
    pass

def test_waits():
    time.sleep(float(os.environ.get("TINY_SLEEP", "0")))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Ray head that is also the first kind's node, and one more logical node per other kind."""
    saved = {k: os.environ.get(k) for k in (*RAY_LOOPBACK_ENV, "TMPDIR")}
    os.environ.update(RAY_LOOPBACK_ENV)  # every Ray service on 127.0.0.1
    # the node jobs' work dirs, and Ray's address file (TMPDIR/ray/ray_current_cluster, not /tmp's)
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("node-tmp"))
    (Path(os.environ["TMPDIR"]) / "ray").mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="rlk-ray-", dir="/tmp")  # Ray's socket paths must stay short
    head = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "resources": {KINDS[0]: 1}, "temp_dir": ray_tmp})
    try:
        nodes = {kind: head.add_node(**NODE_ARGS, resources={kind: 1}) for kind in KINDS[1:]}
        head.wait_for_nodes()
        yield head, nodes, Path(os.environ["TMPDIR"])
    finally:
        head.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def suite(tmp_path):
    """A tiny suite with baselines for the platforms cpu-a and cpu-b (value 1.0, band 0.1)."""
    root = tmp_path / "suite"
    (root / "suites" / "op").mkdir(parents=True)
    (root / "conftest.py").write_text('pytest_plugins = ["pytest_rlk.plugin"]\n')
    (root / "suites" / "op" / "test_tiny.py").write_text(TINY_TESTS)
    for platform in ("cpu-a", "cpu-b"):
        write_baseline(root / "baselines", platform, "test_tiny.test_value", value=1.0)
    return root


def node(name: str, kind: str, platform: str, **more) -> dict:
    return {"name": name, "resources": {kind: 1}, "platform": platform, "timeout_s": 120,
            "pytest_args": [f"--rlk-platform={platform}"], **more}


def nightly(cluster, suite: Path, nodes: list[dict], *, plots: bool = False) -> tuple[int, Path]:
    head, _, _ = cluster
    plan = suite / "plan.json"
    plan.write_text(json.dumps({"schema_version": 1, "name": "ci", "suite_root": str(suite),
                                "sync_interval_s": 0.5, "stop_grace_s": 10, "nodes": nodes}))
    out = suite / "nightly"
    argv = ["nightly", str(plan), "--address", head.address, "--out", str(out), "--suite-root", str(suite)]
    return cli.main(argv + ([] if plots else ["--no-plots"])), out


def test_two_nodes_one_verdict_a_regression_names_its_node(cluster, suite, capsys):
    rc, out = nightly(cluster, suite, [
        node("node-a", "kind_a", "cpu-a"),
        node("node-b", "kind_b", "cpu-b", env={"TINY_VALUE": "2.0"}),  # the injected regression
        node("ghost", "h100", "h100"),  # a node kind the cluster does not have
    ], plots=True)
    text = capsys.readouterr().out
    assert rc == 1
    problems = text.split("problems (", 1)[1].splitlines()[1:]
    assert problems[:3] == [
        "  h100 (node ghost): node: unschedulable: no node of the cluster has {'h100': 1.0} (the cluster has "
        "{'kind_a': 1.0, 'kind_b': 1.0, 'kind_c': 1.0}); no run files arrived",
        "  cpu-b (node node-b): regression: suites/op/test_tiny.py::test_value: value: regression: baseline 1, "
        "new 2 (worse by 1 > band 0.1)",
        "  h100: absent: expected, but no run of this platform was given (its node produced none)",
    ]
    record = json.loads((out / "nightly.json").read_text())
    assert {n: (v["status"], v["exit_status"]) for n, v in record["nodes"].items()} == {
        "node-a": ("completed", 0), "node-b": ("completed", 1), "ghost": ("unschedulable", None)}
    run_a = storage.load_run(out / record["nodes"]["node-a"]["run_dir"] / "run.json")
    assert run_a.status == "complete" and [t.outcome for t in run_a.tests] == ["passed"] * 3
    assert run_a.manifest.platform.tag == "cpu-a"
    report = (out / "verdict" / "report.md").read_text()
    assert "|  | cpu-a | cpu-b | h100 |" in report
    assert "| `suites/op/test_tiny.py::test_value` | passed (1 pass) | failed, regression: value | - |" in report
    assert (out / "verdict" / "verdict.png").exists() and (out / "verdict" / "runs" / "cpu-b-node-b" / "report.md").exists()
    # node-a alone is clean: its own verdict passes
    assert cli.main(["verdict", str(out / record["nodes"]["node-a"]["run_dir"]), "--expect", "cpu-a",
                     "--baselines", str(suite / "baselines"), "--no-plots", "-o", str(out / "a-only")]) == 0


def _tests_received(node_dir: Path) -> int:
    count = 0
    for part in node_dir.glob("runs/*/parts/*.json"):
        try:
            count += len(storage.load_part(part).tests)
        except storage.RlkFileError:
            pass
    return count


def _processes_under(path: Path) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def test_a_killed_node_and_a_timed_out_node_are_named_and_keep_their_runs(cluster, suite, capsys):
    head, nodes, node_tmp = cluster
    result = {}
    plan = [node("ok", "kind_a", "cpu-a"),
            node("slow", "kind_b", "cpu-b", env={"TINY_SLEEP": "60"}, timeout_s=5),
            node("doomed", "kind_c", "cpu-c", env={"TINY_SLEEP": "60"})]
    driver = threading.Thread(target=lambda: result.update(rc=nightly(cluster, suite, plan)[0]))
    driver.start()
    doomed_dir = suite / "nightly" / "nodes" / "doomed"
    deadline = time.monotonic() + 90
    while _tests_received(doomed_dir) < 2 and time.monotonic() < deadline:  # two tests done, one sleeping
        time.sleep(0.2)
    assert _tests_received(doomed_dir) == 2
    head.remove_node(nodes["kind_c"], allow_graceful=False)  # its raylet dies, and its workers with it
    driver.join(timeout=120)
    assert not driver.is_alive() and result["rc"] == 1
    text = capsys.readouterr().out
    record = json.loads((suite / "nightly" / "nightly.json").read_text())
    assert {n: v["status"] for n, v in record["nodes"].items()} == {"ok": "completed", "slow": "timed_out",
                                                                    "doomed": "died"}
    for name, status in (("slow", "interrupted"), ("doomed", "crashed")):  # partial runs, kept
        run = storage.load_run(suite / "nightly" / record["nodes"][name]["run_dir"] / "run.json")
        assert run.status == status and [t.nodeid.split("::")[1] for t in run.tests] == ["test_value", "test_plain"]
    assert "cpu-b (node slow): node: timed_out: stopped after timeout_s=5; partial run kept: nodes/slow/runs/" in text
    assert "cpu-c (node doomed): node: died: NodeDiedError: Task failed because the node it was running on is dead" in text
    deadline = time.monotonic() + 30  # the dead node's pytest got SIGTERM with its parent
    while _processes_under(node_tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes_under(node_tmp)
