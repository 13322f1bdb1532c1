"""Launcher: free loopback ports, local and Ray modes, timeouts, crashes, teardown of its own
processes only. Real subprocesses (the stand-in train.py) and, where ray[default] is installed,
a real Ray head on loopback (~45 s on 2 cores: head start, two jobs, ~3 s orderly teardown)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_rlk.e2e.arms import ArmCommand
from pytest_rlk.e2e.launcher import run_arm
from pytest_rlk.e2e.nvml import nvml_unavailable_reason
from pytest_rlk.e2e.processes import LaunchError, free_ports, session_pids
from pytest_rlk.e2e.ray_head import RayHead

RAY_BIN = os.environ.get("RLK_TEST_RAY_BIN", "ray")
STANDIN = Path(__file__).resolve().parent / "standin_vime_train.py"


def _cmd(env: dict[str, str] | None = None, rollouts: int = 3, workdir: str | None = None) -> ArmCommand:
    return ArmCommand(role="kernels", label="vime+kernels", lane="live",
                      argv=[sys.executable, str(STANDIN), "--num-rollout", str(rollouts), "--seed", "5"],
                      env={"VIME_RL_KERNEL": "1", **(env or {})}, workdir=workdir)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def bystander():
    """A process this test starts outside any arm: teardown must leave it alone."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield proc
    proc.kill()
    proc.wait()


def test_free_ports_are_distinct_and_bindable_on_loopback():
    ports = free_ports(9)
    assert len(set(ports)) == 9
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_local_success_keeps_the_full_log(tmp_path):
    result = run_arm(_cmd(workdir=str(tmp_path)), log_path=tmp_path / "arm" / "job.log", timeout_s=60, mode="local")
    assert result.ok and result.returncode == 0
    text = result.log_path.read_text()
    assert "perf 2: {" in text and "rlk launcher: succeeded" in text and str(STANDIN) in text.splitlines()[1]
    assert result.nvml_reason is None and result.peak_vram_mib_per_gpu == {}


def test_crash_midway_fails_with_the_log_tail(tmp_path):
    result = run_arm(_cmd({"RLK_STANDIN_DIE_AT_ROLLOUT": "1"}), log_path=tmp_path / "job.log", timeout_s=60,
                     mode="local")
    assert result.status == "failed" and result.returncode == 17
    message = result.failure_message()
    assert str(tmp_path / "job.log") in message and "dying midway" in message and "rollout 1: {" in message
    with pytest.raises(LaunchError, match="exit code 17"):
        result.raise_for_status()


def test_timeout_ends_the_arm_and_keeps_partial_output(tmp_path):
    start = time.monotonic()
    result = run_arm(_cmd({"RLK_STANDIN_SLEEP_S": "120"}), log_path=tmp_path / "job.log", timeout_s=6, mode="local")
    assert time.monotonic() - start < 60
    assert result.status == "timeout" and "timed out after 6s" in result.failure_message()
    assert "rollout 0: {" in result.log_path.read_text()


def test_teardown_ends_only_the_arms_own_processes(tmp_path, bystander):
    result = run_arm(_cmd({"RLK_STANDIN_SPAWN_CHILD": "1"}, rollouts=1), log_path=tmp_path / "job.log",
                     timeout_s=60, mode="local")
    assert result.ok
    child = int(next(l for l in result.log_path.read_text().splitlines() if "child pid" in l).split()[-1])
    assert not _alive(child)  # left behind by the arm: ended with its session
    assert _alive(bystander.pid)  # not ours to end


def test_nvml_poll_reports_every_device_or_why_none(tmp_path):
    """Where NVML sees GPUs, a peak for each (device-wide used memory: above zero while the arm
    runs); where it sees none (a CPU host), no peak and the reason, and the arm still succeeds."""
    result = run_arm(_cmd(rollouts=1), log_path=tmp_path / "job.log", timeout_s=60, mode="local", poll_memory=True)
    assert result.ok
    reason = nvml_unavailable_reason()
    if reason is None:
        peaks = result.peak_vram_mib_per_gpu
        assert peaks and sorted(peaks) == list(range(len(peaks))), peaks  # every device NVML reports
        assert all(mib > 0 for mib in peaks.values()) and result.nvml_reason is None
    else:
        assert result.peak_vram_mib_per_gpu == {}
        assert result.nvml_reason is None or result.nvml_reason.startswith("no NVML device")


def _ray_jobs_reason() -> str | None:
    exe = shutil.which(RAY_BIN)
    if exe is None:
        return f"no `{RAY_BIN}` executable"
    python = Path(exe).read_text(errors="replace").splitlines()[0].removeprefix("#!").strip()
    probe = subprocess.run([python, "-c", "import ray._private.utils as u; print(u.get_dashboard_dependency_error() or '')"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0 or probe.stdout.strip():
        return ("`ray job submit` needs ray[default] (the dashboard's HTTP server); this ray is minimal: "
                f"{(probe.stdout + probe.stderr).strip()[-200:]}; set RLK_TEST_RAY_BIN to a ray[default] install")
    return None


def _listening(port: int) -> list[str]:
    """Local addresses (hex) listening on `port` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in list(fh)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hexport = local.rsplit(":", 1)
                if state == "0A" and int(hexport, 16) == port:
                    found.append(address)
    return found


def test_real_ray_head_on_loopback_runs_the_standin_job_and_tears_down(tmp_path, bystander):
    reason = _ray_jobs_reason()
    if reason:
        pytest.skip(reason)
    head = RayHead.start(num_gpus=0, num_cpus=1, log_dir=tmp_path, timeout_s=180, ray_bin=RAY_BIN)
    try:
        for port in (head.ports.port, head.ports.dashboard_port):
            addresses = _listening(port)
            assert addresses, f"nothing listens on {port}"
            # 127.0.0.1 as IPv4 (0100007F) or IPv4-mapped IPv6; never 0.0.0.0 / ::
            assert all(a.endswith("0100007F") for a in addresses), addresses
        pids = session_pids(head.process.pid)
        assert len(pids) >= 3  # gcs, raylet, dashboard ...
        ok = run_arm(_cmd(workdir=str(tmp_path)), log_path=tmp_path / "ok.log", timeout_s=120, mode="ray", head=head)
        assert ok.ok, ok.failure_message()
        assert "perf 2: {" in ok.log_path.read_text() and "SUCCEEDED" in ok.detail
        bad = run_arm(_cmd({"RLK_STANDIN_DIE_AT_ROLLOUT": "0"}), log_path=tmp_path / "bad.log", timeout_s=120,
                      mode="ray", head=head)
        assert bad.status == "failed" and "FAILED" in bad.detail and "dying midway" in bad.failure_message()
    finally:
        head.stop()
        shutil.rmtree(head.temp_dir, ignore_errors=True)  # Ray's session logs: kept by runs, not by tests
    assert session_pids(head.process.pid) == [] and head.process.poll() is not None
    assert _alive(bystander.pid)
