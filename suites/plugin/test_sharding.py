"""--rlk-shard-gpus: one xdist worker per GPU, pinned; multi-GPU tests in an all-GPU phase; the
sharded run gives the same per-test results as the serial one (`rlk same`).

The GPUs are fake (this runs on CPU): a conftest platform hook reports two GPUs (the tests never
touch CUDA), or the RLK_FAKE_GPUS seam gives the sharding device ids on the CPU platform."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from nightly_testing import metric, result
from rlk_plugin_testing import REPO_ROOT, checkout_pythonpath, latest_run_dir, needs_gpuless_host

from pytest_rlk import cli, options, sharding, storage
from pytest_rlk.same_results import compare_runs
from pytest_rlk.schema import DeviceInfo, MetricRecord, PlatformInfo, RunManifest, RunRecord

CPU = PlatformInfo(tag="cpu", detected_tag="cpu")
TWO_GPUS = PlatformInfo(tag="h200", detected_tag="h200", device_name="NVIDIA H200", device_count=2,
                        memory_bytes=150_000_000_000, capability="9.0",
                        devices=[DeviceInfo(index=i, name="NVIDIA H200", memory_bytes=150_000_000_000,
                                            capability="9.0") for i in range(2)])


def test_gpu_ids_follow_the_visible_devices():
    assert sharding.node_gpu_ids(TWO_GPUS, {}) == ["0", "1"]
    # torch's device i is the i-th visible one: worker i must get that id, not i
    assert sharding.node_gpu_ids(TWO_GPUS, {"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3", "5"]
    with pytest.raises(sharding.ShardError, match="lists 1 devices but torch sees 2"):
        sharding.node_gpu_ids(TWO_GPUS, {"CUDA_VISIBLE_DEVICES": "3"})
    assert sharding.node_gpu_ids(CPU, {}) == []


def test_fake_gpus_seam_is_for_cpu_machines_only(monkeypatch):
    assert sharding.node_gpu_ids(CPU, {}, fake=2) == ["0", "1"]
    with pytest.raises(sharding.ShardError, match="a test seam for machines without GPUs"):
        sharding.node_gpu_ids(TWO_GPUS, {}, fake=2)
    monkeypatch.setenv("RLK_FAKE_GPUS", "2")
    assert sharding.fake_gpu_count() == 2
    monkeypatch.setenv("RLK_FAKE_GPUS", "two")
    with pytest.raises(sharding.ShardError, match="RLK_FAKE_GPUS='two': expected a positive int"):
        sharding.fake_gpu_count()


def test_worker_specs_pin_one_gpu_each():
    specs = sharding.worker_tx_specs(["popen", "popen"], ["3", "5"])
    assert specs == ["popen//env:CUDA_VISIBLE_DEVICES=3", "popen//env:CUDA_VISIBLE_DEVICES=5"]
    assert sharding.shard_map(specs, ["3", "5"]) == {"gw0": "3", "gw1": "5", "all-gpus": "3,5"}
    assert sharding.worker_tx_specs(["popen"], ["3", "5"]) == ["popen//env:CUDA_VISIBLE_DEVICES=3"]
    for tx, gpus, message in (([], ["0"], "add -n auto"), (["ssh=host"], ["0"], "use -n N"),
                              (["popen"], [], "no GPU to shard over"),
                              (["popen"] * 3, ["0", "1"], "two workers would share a GPU")):
        with pytest.raises(sharding.ShardError, match=message):
            sharding.worker_tx_specs(tx, gpus)


def test_workers_sharing_gpus_take_them_in_turn():
    specs = sharding.worker_tx_specs(["popen"] * 4, ["3", "5"], per_gpu=2)
    assert specs == [f"popen//env:CUDA_VISIBLE_DEVICES={g}" for g in ("3", "5", "3", "5")]
    assert sharding.shard_map(specs, ["3", "5"]) == {"gw0": "3", "gw1": "5", "gw2": "3", "gw3": "5", "all-gpus": "3,5"}
    with pytest.raises(sharding.ShardError, match="-n 5 workers for 2 GPUs at --rlk-workers-per-gpu=2: at most 4"):
        sharding.worker_tx_specs(["popen"] * 5, ["3", "5"], per_gpu=2)
    with pytest.raises(sharding.ShardError, match="or --rlk-workers-per-gpu K"):
        sharding.worker_tx_specs(["popen"] * 2, ["0"])


def test_what_times_the_gpu_waits_for_the_all_gpu_phase_only_where_workers_share_it():
    for marks in ([("bench", ())], [("exclusive_gpu", ())], [("gpu", ()), ("bench", ())], [("gpu_mem", (40,))]):
        assert sharding.runs_in_all_gpu_phase(marks, unserved=False, shared_gpus=True), marks
        assert not sharding.runs_in_all_gpu_phase(marks, unserved=False), marks  # one worker per GPU
    assert not sharding.runs_in_all_gpu_phase([("gpu", ())], unserved=False, shared_gpus=True)
    assert not sharding.runs_in_all_gpu_phase([("bench", ())], unserved=True, shared_gpus=True)  # skips anyway


def test_a_worker_sharing_its_gpu_returns_the_cached_blocks(monkeypatch):
    class FakeCuda:
        def __init__(self, initialized):
            self.initialized, self.emptied = initialized, 0

        def is_initialized(self):
            return self.initialized

        def empty_cache(self):
            self.emptied += 1

    for initialized in (True, False):
        fake = type("FakeTorch", (), {"cuda": FakeCuda(initialized)})()
        monkeypatch.setitem(sys.modules, "torch", fake)
        assert sharding.release_cached_gpu_memory() is initialized and fake.cuda.emptied == int(initialized)
    monkeypatch.delitem(sys.modules, "torch")
    assert sharding.release_cached_gpu_memory() is False  # torch never imported: nothing to return


def test_workers_per_gpu_is_a_whole_number_given_with_sharding():
    assert options.parse_workers_per_gpu(None, False) == 1 and options.parse_workers_per_gpu("3", True) == 3
    assert options.parse_workers_per_gpu("1", False) == 1
    for text, shard, message in (("two", True, "is not a whole number"), ("0", True, "must be >= 1"),
                                 ("2", False, "it needs --rlk-shard-gpus")):
        with pytest.raises(options.OptionError, match=message):
            options.parse_workers_per_gpu(text, shard)


def test_controller_pins_and_workers_check_themselves(tmp_path):
    specs, shards = sharding.pin_workers(["popen", "popen"], TWO_GPUS, {"CUDA_VISIBLE_DEVICES": "3,5"}, ["-n", "2"])
    assert specs == ["popen//env:CUDA_VISIBLE_DEVICES=3", "popen//env:CUDA_VISIBLE_DEVICES=5"]
    assert shards == {"gw0": "3", "gw1": "5", "all-gpus": "3,5"}
    ini = tmp_path / "pyproject.toml"
    told = sharding.worker_input({"CUDA_VISIBLE_DEVICES": "5"}, ini)
    sharding.check_worker(told, {"CUDA_VISIBLE_DEVICES": "5"}, ini)
    with pytest.raises(sharding.ShardError, match="should see GPU 5 but CUDA_VISIBLE_DEVICES='5,3'"):
        sharding.check_worker(told, {"CUDA_VISIBLE_DEVICES": "5,3"}, ini)
    with pytest.raises(sharding.ShardError, match="read the config file None but the controller read"):
        sharding.check_worker(told, {"CUDA_VISIBLE_DEVICES": "5"}, None)
    with pytest.raises(sharding.ShardError, match="needs pytest-xdist"):
        sharding.check_xdist(False)


def test_multi_gpu_tests_are_held_back_in_order():
    items = [("a", [("gpus", (2,))], False), ("b", [], False), ("c", [("gpus", (4,))], True), ("d", [("gpus", (8,))], False)]
    keep, held = sharding.split_held_back(items, lambda item: (item[1], item[2]))
    assert [i[0] for i in keep] == ["b", "c"] and [i[0] for i in held] == ["a", "d"]


def _run_of(*tests) -> RunRecord:
    manifest = RunManifest(run_id="r", created_utc="2026-01-01T00:00:00.000000Z", argv=[], tiers=["op"],
                           platform=PlatformInfo(tag="cpu", detected_tag="cpu"), software={})
    return RunRecord(manifest=manifest, status="complete", exit_status=0, tests=list(tests))


def test_same_results_compares_computed_values_not_timings():
    def run(err: float, ms: float, outcome: str = "passed") -> RunRecord:
        timing = MetricRecord(name="rlk_ms", value=ms, direction="lower_is_better", space="time")
        error = metric("max_abs_err", err).model_copy(update={"gate": False, "space": "error"})
        return _run_of(result("t.py::test_a", outcome, [error, timing]), result("t.py::test_b"))

    assert compare_runs(run(1e-7, 1.0), run(1e-7, 1.3)) == []  # timings vary run to run
    assert [d.line() for d in compare_runs(run(1e-7, 1.0), run(1e-7, 1.3), measured=True, rel_tol=0.1)] == [
        "t.py::test_a: rlk_ms: A 1.0, B 1.3"]
    assert [d.line() for d in compare_runs(run(1e-7, 1.0), run(2e-7, 1.0, "failed"))] == [
        "t.py::test_a: outcome: A passed, B failed", "t.py::test_a: max_abs_err: A 1e-07, B 2e-07"]  # ungated too
    assert [d.line() for d in compare_runs(run(1e-7, 1.0), _run_of(result("t.py::test_b")))] == ["t.py::test_a: only in A"]


def test_multi_gpu_tests_wait_for_the_all_gpu_phase():
    assert sharding.runs_in_all_gpu_phase([("gpus", (2,)), ("bench", ())], unserved=False)
    assert not sharding.runs_in_all_gpu_phase([("gpus", (2,))], unserved=True)  # skips anyway
    assert not sharding.runs_in_all_gpu_phase([("gpu", ()), ("bench", ())], unserved=False)
    assert not sharding.runs_in_all_gpu_phase([("gpus", (1,))], unserved=False)
    argv = sharding.all_gpu_phase_argv(["suites/op", "-n", "2", "--rlk-shard-gpus"], "/runs/r1")
    assert argv[:3] == [sys.executable, "-m", "pytest"]
    assert argv[-4:] == ["-n", "0", "--dist=no", "--rlk-all-gpu-phase=/runs/r1"]  # the last ones win


FAKE_TWO_GPU_CONFTEST = """
pytest_plugins = ["pytest_rlk.plugin"]
from pytest_rlk.schema import DeviceInfo, PlatformInfo

def pytest_rlk_platform(config):
    # stands in for a node with two GPUs (the tests below never touch CUDA)
    devices = [DeviceInfo(index=i, name="NVIDIA H200", memory_bytes=150_000_000_000, capability="9.0")
               for i in range(2)]
    return PlatformInfo(tag="h200", detected_tag="h200", device_name="NVIDIA H200", device_count=2,
                        memory_bytes=150_000_000_000, capability="9.0", devices=devices)
"""

# Each test logs which GPU it saw and when it held it; sleeps make the workers overlap in time.
SHARDED_TESTS = """
import json, math, os, time
import pytest

@pytest.fixture(autouse=True)
def gpu_usage(request):
    start = time.monotonic()
    yield
    record = {"nodeid": request.node.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
              "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.monotonic(),
              "bench": request.node.get_closest_marker("bench") is not None}
    with open(os.environ["SHARD_LOG"], "a") as fh:
        fh.write(json.dumps(record) + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_parity(rlk_metrics, i):
    time.sleep(0.15)
    rlk_metrics.record("max_abs_err", abs(math.sin(i)) * 1e-7, direction="lower_is_better", space="error")

@pytest.mark.bench
@pytest.mark.parametrize("j", range(2))
def test_bench(rlk_metrics, j):
    time.sleep(0.3)
    rlk_metrics.record("rlk_ms", 1.0 + j, direction="lower_is_better", space="time")

@pytest.mark.gpus(2)
def test_tp2(rlk_metrics):
    assert os.environ.get("FAIL_TP2") != "1", "TP=2 differs from TP=1"
    rlk_metrics.record("tp2_err", 1e-6 + float(os.environ.get("TP2_OFFSET", "0")), direction="lower_is_better")

@pytest.mark.gpus(4)
def test_needs_four():
    pass
"""


def _usage(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def _two_gpu_node_and_its_serial_run(rlk_pytester, monkeypatch) -> Path:
    """The sharded tests on a stand-in node of two GPUs (3 and 5), run serially once: that run's dir."""
    rlk_pytester.makeconftest(FAKE_TWO_GPU_CONFTEST)
    rlk_pytester.makepyfile(**{"suites/op/test_sharded": SHARDED_TESTS})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # the node's GPUs as this process sees them
    monkeypatch.delenv("RLK_FAKE_GPUS", raising=False)
    monkeypatch.setenv("SHARD_LOG", str(rlk_pytester.path / "serial.jsonl"))
    rlk_pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=9, skipped=1)
    return latest_run_dir(rlk_pytester)


def _sharded_run(pytester, monkeypatch, name: str, *args: str):
    """``-n auto --rlk-shard-gpus ARGS`` in a subprocess, each test's GPU use logged: (the result,
    the run's directory, the log); the run passed."""
    log = pytester.path / f"{name}.jsonl"
    monkeypatch.setenv("SHARD_LOG", str(log))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "auto", "--rlk-shard-gpus", *args)
    assert result.ret == 0
    return result, latest_run_dir(pytester), log


def test_sharded_run_pins_each_worker_and_matches_the_serial_run(rlk_pytester, monkeypatch, capsys):
    serial = _two_gpu_node_and_its_serial_run(rlk_pytester, monkeypatch)

    result, sharded, log = _sharded_run(rlk_pytester, monkeypatch, "sharded")
    result.stdout.fnmatch_lines(["*created: 2/2 workers*", "*all-GPU phase: 1 test that needs more than one GPU"
                                 " or a GPU to itself, alone on the node with GPUs 3,5 visible",
                                 "*all-GPU phase: 1 passed"])
    run = storage.load_run(sharded / "run.json")
    assert run.status == "complete" and len(run.tests) == 10
    assert run.manifest.gpu_shards == {"gw0": "3", "gw1": "5", "all-gpus": "3,5"}
    assert sorted(p.name for p in (sharded / "parts").glob("*.json")) == ["all-gpus.json", "gw0.json", "gw1.json"]

    usage = _usage(log)
    assert {u["worker"]: u["gpus"] for u in usage} == {"gw0": "3", "gw1": "5", "main": "3,5"}  # worker i: GPU i
    assert {u["nodeid"].split("::")[1] for u in usage if u["worker"] == "main"} == {"test_tp2"}
    assert len({u["worker"] for u in usage if not u["bench"] and u["worker"] != "main"}) == 2  # both worked
    by_gpu = defaultdict(list)
    for u in usage:
        for gpu in u["gpus"].split(","):
            by_gpu[gpu].append(u)
    for gpu, uses in by_gpu.items():  # one test per GPU at a time: benchmarks time alone
        clashes = [(a["nodeid"], b["nodeid"]) for k, a in enumerate(uses) for b in uses[k + 1:] if _overlap(a, b)]
        assert not clashes, f"GPU {gpu} held by two tests at once: {clashes}"

    capsys.readouterr()
    assert cli.main(["same", str(serial), str(sharded)]) == 0
    assert ("same results: 10 tests, the same outcomes and computed values (timings not compared) (exactly)"
            in capsys.readouterr().out)

    # a failure in the all-GPU phase fails the session, and `rlk same` names what differs
    monkeypatch.setenv("FAIL_TP2", "1")
    result = rlk_pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--rlk-shard-gpus")
    assert result.ret == 1  # the workers' tests all passed
    result.stdout.fnmatch_lines(["*all-GPU phase: 1 failed*"])
    assert cli.main(["same", str(serial), str(latest_run_dir(rlk_pytester))]) == 1
    out = capsys.readouterr().out
    assert "suites/op/test_sharded.py::test_tp2: outcome: A passed, B failed" in out
    assert "suites/op/test_sharded.py::test_tp2: tp2_err: only in A" in out


def test_workers_sharing_each_gpu_leave_the_benchmarks_to_the_all_gpu_phase(rlk_pytester, monkeypatch, capsys):
    """--rlk-workers-per-gpu 2 on two GPUs: four workers, two on each GPU, run the parity tests side
    by side; the benchmarks and the TP=2 test run after them, alone, with the serial run's results."""
    serial = _two_gpu_node_and_its_serial_run(rlk_pytester, monkeypatch)

    result, shared, log = _sharded_run(rlk_pytester, monkeypatch, "shared", "--rlk-workers-per-gpu=2")
    result.stdout.fnmatch_lines(["*created: 4/4 workers*", "*all-GPU phase: 3 tests that need more than one GPU"
                                 " or a GPU to themselves, alone on the node with GPUs 3,5 visible",
                                 "*all-GPU phase: 3 passed"])
    run = storage.load_run(shared / "run.json")
    assert run.manifest.gpu_shards == {"gw0": "3", "gw1": "5", "gw2": "3", "gw3": "5", "all-gpus": "3,5"}
    usage = _usage(log)
    alone = [u for u in usage if u["bench"] or u["nodeid"].endswith("test_tp2")]
    assert {u["worker"] for u in alone} == {"main"}, alone
    assert all(u["gpus"] == run.manifest.gpu_shards[u["worker"]] for u in usage if u["worker"] != "main")
    for a in alone:  # nothing else held any GPU while a benchmark timed
        clashes = [u["nodeid"] for u in usage if u is not a and _overlap(a, u)]
        assert not clashes, (a["nodeid"], clashes)
    capsys.readouterr()
    assert cli.main(["same", str(serial), str(shared)]) == 0


@needs_gpuless_host
def test_fake_gpu_ids_on_the_cpu_platform(rlk_pytester, monkeypatch):
    """RLK_FAKE_GPUS: the CPU platform (gpus(n) tests skip as on any CPU machine), workers pinned to
    fake ids 0 and 1."""
    rlk_pytester.makepyfile(**{"suites/op/test_sharded": SHARDED_TESTS})
    log = rlk_pytester.path / "usage.jsonl"
    monkeypatch.setenv("SHARD_LOG", str(log))
    monkeypatch.setenv("RLK_FAKE_GPUS", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result = rlk_pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--rlk-shard-gpus")
    result.assert_outcomes(passed=8, skipped=2)
    assert "all-GPU phase" not in result.stdout.str()
    assert {u["worker"]: u["gpus"] for u in _usage(log)} == {"gw0": "0", "gw1": "1"}


@needs_gpuless_host
@pytest.mark.parametrize("args, env, message", [
    (["--rlk-shard-gpus"], {"RLK_FAKE_GPUS": "2"}, "one pytest-xdist worker per GPU: add -n auto"),
    (["-n", "3", "--rlk-shard-gpus"], {"RLK_FAKE_GPUS": "2"}, "-n 3 workers for 2 GPUs"),
    (["-n", "2", "--rlk-workers-per-gpu=2"], {"RLK_FAKE_GPUS": "2"}, "it needs --rlk-shard-gpus"),
    (["-n", "2", "--rlk-shard-gpus"], {}, "this machine has no GPU to shard over"),
    (["--rlk-shard-gpus", "-p", "no:xdist"], {"RLK_FAKE_GPUS": "2"}, "--rlk-shard-gpus needs pytest-xdist"),
    (["-n", "2", "--rlk-shard-gpus", "--rlk-artifacts", "runs"], {"RLK_FAKE_GPUS": "2"}, "--rlk-artifacts=DIR with '='"),
])
def test_sharding_usage_errors(rlk_pytester, monkeypatch, args, env, message):
    rlk_pytester.makepyfile(**{"suites/op/test_one": "def test_one():\n    pass\n"})
    monkeypatch.delenv("RLK_FAKE_GPUS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = rlk_pytester.runpytest("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


OP_SUBSET = "suites/op/test_ratio_kl.py"  # 26 real parity tests of one op, a few seconds on CPU


def _op_run(artifacts: Path, *args: str, env: dict[str, str]) -> RunRecord:
    argv = [sys.executable, "-m", "pytest", OP_SUBSET, "--rlk-tier=op", "-q", "-p", "no:cacheprovider",
            f"--rlk-artifacts={artifacts}", *args]
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return storage.load_run(storage.resolve_run_file("latest", artifacts))


@needs_gpuless_host
def test_sharded_op_tier_gives_the_serial_results(tmp_path):
    """The real op suite of one operator, serial and over two (fake) GPUs: the same tests, the
    same outcomes, the same parity errors."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CUDA_VISIBLE", "RLK_FAKE"))}
    env["PYTHONPATH"] = checkout_pythonpath(os.environ.get("PYTHONPATH"))
    serial = _op_run(tmp_path / "serial", env=env)
    sharded = _op_run(tmp_path / "sharded", "-n", "2", "--rlk-shard-gpus", env={**env, "RLK_FAKE_GPUS": "2"})
    assert {t.worker for t in serial.tests} == {"main"} and {t.worker for t in sharded.tests} == {"gw0", "gw1"}
    assert sharded.manifest.gpu_shards == {"gw0": "0", "gw1": "1", "all-gpus": "0,1"}
    compared = sum(1 for t in serial.tests for m in t.metrics if m.space == "error")
    assert len(serial.tests) == 26 and compared > 20  # parity errors, compared value by value
    assert [d.line() for d in compare_runs(serial, sharded)] == []


def test_the_nightly_shares_a_gpu_by_its_memory_and_the_cores():
    h100, h200 = 81559 << 20, 143771 << 20  # nvidia-smi's memory.total, MiB
    assert sharding.nightly_workers_per_gpu(h100, 16) == 4
    assert sharding.nightly_workers_per_gpu(h200, 16) == 7
    assert sharding.nightly_workers_per_gpu(h200, 16, gpu_count=8) == 1  # two cores per worker
    assert sharding.nightly_workers_per_gpu(10**9, 2) == 1
    with pytest.raises(ValueError, match="positive"):
        sharding.nightly_workers_per_gpu(h100, 0)


def test_the_all_gpu_phase_leaves_out_files_and_folders_without_its_tests():
    held = ["suites/op/bench_logp.py::test_bench[bf16]", "suites/module/test_training_step.py::test_big"]
    assert not sharding.outside_phase("suites/op/bench_logp.py", False, held)
    assert sharding.outside_phase("suites/op/test_logp.py", False, held)
    assert not sharding.outside_phase("suites/op", True, held) and not sharding.outside_phase("suites", True, held)
    assert sharding.outside_phase("suites/e2e", True, held) and sharding.outside_phase("suites/op/launch", True, held)
    for kept in ("suites/op/conftest.py", "suites/op/launch/__init__.py", "suites/op/cases.json", ".", ""):
        assert not sharding.outside_phase(kept, False, held), kept


ELSEWHERE = """
import os

with open(os.environ["IMPORT_LOG"], "a") as fh:  # who imports this module
    fh.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")

def test_plain():
    pass
"""


def test_the_all_gpu_phase_imports_only_the_files_of_its_tests(rlk_pytester, monkeypatch):
    rlk_pytester.makeconftest(FAKE_TWO_GPU_CONFTEST)
    rlk_pytester.makepyfile(**{"suites/op/test_sharded": SHARDED_TESTS, "suites/op/test_elsewhere": ELSEWHERE})
    imports = rlk_pytester.path / "imports.txt"
    monkeypatch.setenv("IMPORT_LOG", str(imports))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.delenv("RLK_FAKE_GPUS", raising=False)
    result, _, _ = _sharded_run(rlk_pytester, monkeypatch, "phase", "--rlk-workers-per-gpu=2")
    result.stdout.fnmatch_lines(["*all-GPU phase: 3 passed"])
    importers = imports.read_text().split()
    assert importers and "main" not in importers, importers  # the workers imported it, the phase did not
