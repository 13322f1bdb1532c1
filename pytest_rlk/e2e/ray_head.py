"""A Ray head of our own for one arm, and `ray job submit` to it (the upstream way to start vime).

The head is ours: `ray start --head --block` in a new session, every Ray service on its own free
port, bound to loopback, a temp dir of its own. `RayHead.stop` ends exactly its session's
processes (`pytest_rlk.e2e.processes`); never `ray stop`, which would end other users' clusters.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pytest_rlk.e2e.arms import ArmCommand
from pytest_rlk.e2e.processes import LOOPBACK, LaunchError, end_session, free_ports, tail

# Ray replaces a loopback --node-ip-address with the machine's routable IP unless its cluster mode
# is off; off, every Ray service (GCS included) binds to 127.0.0.1. Single-node runs need no more.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
_RAY_PORT_FLAGS = (
    "port",
    "dashboard-port",
    "node-manager-port",
    "object-manager-port",
    "runtime-env-agent-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "ray-client-server-port",
)


@dataclass(frozen=True)
class RayPorts:
    port: int
    dashboard_port: int
    node_manager_port: int
    object_manager_port: int
    runtime_env_agent_port: int
    dashboard_agent_listen_port: int
    dashboard_agent_grpc_port: int
    metrics_export_port: int
    ray_client_server_port: int

    @classmethod
    def pick(cls) -> RayPorts:
        return cls(*free_ports(len(_RAY_PORT_FLAGS)))

    def flags(self) -> list[str]:
        values = [getattr(self, flag.replace("-", "_")) for flag in _RAY_PORT_FLAGS]
        return [f"--{flag}={value}" for flag, value in zip(_RAY_PORT_FLAGS, values, strict=True)]


def ray_start_argv(ports: RayPorts | None, temp_dir: str, num_gpus: int, *, num_cpus: int | None = None,
                   ray_bin: str = "ray") -> list[str]:
    """The head's command; with ports=None, placeholders (for `plan`)."""
    port_flags = ports.flags() if ports else [f"--{flag}=<free port>" for flag in _RAY_PORT_FLAGS]
    argv = [ray_bin, "start", "--head", "--block", f"--node-ip-address={LOOPBACK}",
            f"--dashboard-host={LOOPBACK}", "--include-dashboard=true", *port_flags,
            # Worker ports: 0/0 lets the OS pick free ones, so two heads never collide.
            "--min-worker-port=0", "--max-worker-port=0",
            f"--temp-dir={temp_dir}", f"--num-gpus={num_gpus}", "--disable-usage-stats"]
    if num_cpus is not None:
        argv.append(f"--num-cpus={num_cpus}")
    return argv


@dataclass
class RayHead:
    """A Ray head this launcher started; `stop()` ends exactly its processes."""

    ports: RayPorts
    temp_dir: Path
    log_path: Path
    process: subprocess.Popen
    argv: list[str]
    ray_bin: str = "ray"

    @property
    def dashboard_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.dashboard_port}"

    @classmethod
    def start(cls, *, num_gpus: int, log_dir: Path, timeout_s: float = 120.0, num_cpus: int | None = None,
              ray_bin: str = "ray", env: Mapping[str, str] | None = None) -> RayHead:
        """`env`: the head's environment (default: this process's); its workers inherit it."""
        log_dir.mkdir(parents=True, exist_ok=True)
        # Ray's unix socket paths must stay short (< 108 bytes): the temp dir goes under /tmp.
        temp_dir = Path(tempfile.mkdtemp(prefix="rlk-ray-", dir="/tmp"))
        ports = RayPorts.pick()
        argv = ray_start_argv(ports, str(temp_dir), num_gpus, num_cpus=num_cpus, ray_bin=ray_bin)
        log_path = log_dir / "ray_head.log"
        with log_path.open("w") as log:
            log.write("$ " + shlex.join(argv) + "\n")
            log.flush()
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True,
                                       env={**(os.environ if env is None else env), **RAY_LOOPBACK_ENV})
        head = cls(ports, temp_dir, log_path, process, argv, ray_bin)
        try:
            head._wait_ready(timeout_s)
        except BaseException:
            head.stop()
            raise
        return head

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LaunchError(
                    f"ray head exited with {self.process.returncode} before it was ready; "
                    f"log {self.log_path}:\n{tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise LaunchError(
            f"ray head not ready after {timeout_s:.0f}s (dashboard {self.dashboard_url} does not "
            f"answer; `ray job submit` needs ray[default]); log {self.log_path}:\n{tail(self.log_path)}"
        )

    def stop(self, grace_s: float = 40.0) -> list[int]:
        """End the head's session (gcs, raylet, dashboard, workers, job drivers): `ray start
        --block` is asked first (it stops its processes in order), then whatever is left."""
        return end_session(self.process, grace_s=grace_s, leader_first_s=20.0)


def shell_command(cmd: ArmCommand) -> str:
    """The arm's command as one shell line (cd + exec): the job entrypoint in ray mode (local mode
    runs the same argv in the same workdir)."""
    run = shlex.join(cmd.argv)
    return f"cd {shlex.quote(cmd.workdir)} && exec {run}" if cmd.workdir else f"exec {run}"


def runtime_env_json(cmd: ArmCommand) -> str:
    return json.dumps({"env_vars": {**RAY_LOOPBACK_ENV, **cmd.full_env}}, sort_keys=True)


def job_submit_argv(cmd: ArmCommand, dashboard_url: str, submission_id: str, ray_bin: str = "ray") -> list[str]:
    return [ray_bin, "job", "submit", f"--address={dashboard_url}", f"--submission-id={submission_id}",
            f"--runtime-env-json={runtime_env_json(cmd)}", "--", "bash", "-c", shell_command(cmd)]


# `ray job status` prints "Job 'ID' succeeded|failed|stopped", "Job 'ID' is currently running"
# (older: "Status for job 'ID': SUCCEEDED"), followed by the job's log tail: only the status line
# counts (the tail can say anything, e.g. "Running entrypoint").
_JOB_STATUS = re.compile(
    r"(?:Job '[^']+' (?:is currently )?|Status for job '[^']+': )(SUCCEEDED|FAILED|STOPPED|RUNNING|PENDING)\b",
    re.IGNORECASE,
)
_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def ray_job_status(head: RayHead, submission_id: str, *, settle_s: float = 60.0) -> str:
    """The job's final status; the head can report RUNNING for a moment after the driver exits."""
    deadline = time.monotonic() + settle_s
    while True:
        out = subprocess.run(
            [head.ray_bin, "job", "status", f"--address={head.dashboard_url}", submission_id],
            capture_output=True, text=True, timeout=60, env={**os.environ, **RAY_LOOPBACK_ENV},
        )
        statuses = _JOB_STATUS.findall(out.stdout + out.stderr)
        status = statuses[0].upper() if statuses else f"UNKNOWN ({(out.stdout + out.stderr).strip()[-300:]})"
        if status in _TERMINAL or time.monotonic() > deadline:
            return status
        time.sleep(1.0)


def stop_ray_job(head: RayHead, submission_id: str) -> None:
    subprocess.run([head.ray_bin, "job", "stop", f"--address={head.dashboard_url}", submission_id],
                   capture_output=True, timeout=60, env={**os.environ, **RAY_LOOPBACK_ENV})
