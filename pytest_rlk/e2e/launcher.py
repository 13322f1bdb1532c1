"""Launcher: runs one arm's command under its own Ray head (or as a local subprocess), safely.

Safety rules (vime's own test helper kills by broad name and runs `ray stop --force`, which would
end other users' clusters on a shared host):
- the Ray head is ours: `ray start --head --block` in a new session, every Ray service on its own
  free port, bound to loopback, temp dir of its own;
- teardown ends only processes of the sessions this launcher created (found through /proc by
  session id), first SIGTERM, then SIGKILL after a grace period; never `ray stop`;
- every arm writes its full log to a file that is kept; a failure message carries its tail.

Two modes share the log / timeout / teardown code: `ray` (`ray job submit` to our head, the
upstream way of starting vime) and `local` (the command runs directly as a subprocess; used by
engines that need no Ray and by the tests).
"""

from __future__ import annotations

import codecs
import json
import os
import re
import selectors
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pytest_rlk.e2e.nvml import NvmlPeakPoller, NvmlUnavailable
from pytest_rlk.e2e.spec import ArmCommand

LaunchMode = Literal["ray", "local"]
ArmStatus = Literal["succeeded", "failed", "timeout"]

LOOPBACK = "127.0.0.1"
# Ray replaces a loopback --node-ip-address with the machine's routable IP unless its cluster mode
# is off; off, every Ray service (GCS included) binds to 127.0.0.1. Single-node runs need no more.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
TAIL_LINES = 60
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


class LaunchError(RuntimeError):
    """The Ray head or an arm could not run; the message names the log file and its tail."""


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    if not path.exists():
        return f"<{path} was not written>"
    with path.open(encoding="utf-8", errors="replace") as fh:
        return "".join(deque(fh, maxlen=lines)).rstrip("\n")


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports free on `host` now (all held open together while choosing)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def session_pids(session_id: int) -> list[int]:
    """PIDs whose session id is `session_id` (Linux /proc), excluding this process."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        # After ")" the fields are: state ppid pgrp session ...
        if int(fields[3]) == session_id and fields[0] != "Z":
            found.append(int(entry))
    return found


def _wait_session_empty(leader: subprocess.Popen, sid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if leader.poll() is not None and not session_pids(sid):
            return True
        time.sleep(0.2)
    return False


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_session(leader: subprocess.Popen, *, grace_s: float = 20.0, leader_first_s: float = 0.0) -> list[int]:
    """End every process of the session `leader` started (it was started with
    start_new_session=True, so the session id is its pid): SIGTERM, wait, SIGKILL. Returns the
    pids that were signalled. Touches nothing outside that session.

    `leader_first_s` > 0: SIGTERM the leader alone first and give it that long to end its own
    children in order (`ray start --block` does: ~6 s, where SIGTERM to every Ray process at once
    leaves the raylet respawning agents and waiting on the dead GCS for 30 s and more); whatever is
    left then gets the SIGTERM / `grace_s` / SIGKILL sequence.
    """
    sid = leader.pid
    signalled: set[int] = set()
    if leader_first_s > 0 and leader.poll() is None:
        signalled.add(sid)
        _signal([sid], signal.SIGTERM)
        if _wait_session_empty(leader, sid, leader_first_s):
            leader.wait()
            return sorted(signalled)
    rest = sorted(set(session_pids(sid)) | ({sid} if leader.poll() is None else set()))
    signalled.update(rest)
    _signal(rest, signal.SIGTERM)
    _wait_session_empty(leader, sid, grace_s)
    _signal(session_pids(sid), signal.SIGKILL)
    try:
        leader.wait(timeout=10)
    except subprocess.TimeoutExpired as exc:
        raise LaunchError(f"pid {sid} survived SIGKILL") from exc
    return sorted(signalled)


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
              ray_bin: str = "ray") -> RayHead:
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
                                       start_new_session=True, env={**os.environ, **RAY_LOOPBACK_ENV})
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


@dataclass
class ArmResult:
    command: ArmCommand
    mode: LaunchMode
    status: ArmStatus
    returncode: int | None
    log_path: Path
    duration_s: float
    launch_argv: list[str]
    peak_vram_mib_per_gpu: dict[int, float] = field(default_factory=dict)
    nvml_reason: str | None = None
    detail: str = ""
    head_argv: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    def failure_message(self) -> str:
        return (
            f"arm {self.command.label!r} ({self.command.lane} lane, {self.mode} mode) {self.status}: "
            f"exit code {self.returncode} after {self.duration_s:.1f}s{'; ' + self.detail if self.detail else ''}. "
            f"Full log: {self.log_path}\n--- last {TAIL_LINES} lines ---\n{tail(self.log_path)}"
        )

    def raise_for_status(self) -> None:
        if not self.ok:
            raise LaunchError(self.failure_message())


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


def _ray_job_status(head: RayHead, submission_id: str, *, settle_s: float = 60.0) -> str:
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


def _stop_ray_job(head: RayHead, submission_id: str) -> None:
    subprocess.run([head.ray_bin, "job", "stop", f"--address={head.dashboard_url}", submission_id],
                   capture_output=True, timeout=60, env={**os.environ, **RAY_LOOPBACK_ENV})


def run_arm(
    cmd: ArmCommand,
    *,
    log_path: Path,
    timeout_s: float,
    mode: LaunchMode,
    head: RayHead | None = None,
    poll_memory: bool = False,
) -> ArmResult:
    """Run one arm to completion or timeout; the full output goes to `log_path` (kept).

    Never raises for a failing job: the result says what happened (call `raise_for_status`), so
    the caller can still parse the partial log.
    """
    if mode == "ray" and head is None:
        raise ValueError("run_arm(mode='ray') needs the RayHead to submit to")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    submission_id = f"rlk-{cmd.role}-{cmd.lane}-{os.getpid()}-{int(time.time() * 1000)}"
    if mode == "ray":
        argv = job_submit_argv(cmd, head.dashboard_url, submission_id, head.ray_bin)
        env = {**os.environ, **RAY_LOOPBACK_ENV}
        cwd = None
    else:
        argv = list(cmd.argv)
        env = {**os.environ, **cmd.full_env}
        cwd = cmd.workdir
    poller: NvmlPeakPoller | None = None
    nvml_reason: str | None = None
    if poll_memory:
        try:
            poller = NvmlPeakPoller().start()
        except NvmlUnavailable as exc:
            nvml_reason = str(exc)
    status: ArmStatus = "failed"
    detail = ""
    start = time.monotonic()
    with log_path.open("w", encoding="utf-8") as log:
        log.write(f"# rlk launcher, {mode} mode\n# $ {shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env=env, start_new_session=True)
        timed_out = _pump(proc, log, deadline=start + timeout_s)
        if timed_out:
            status, detail = "timeout", f"timed out after {timeout_s:.0f}s"
            if mode == "ray":
                _stop_ray_job(head, submission_id)
        end_session(proc)
        returncode = proc.returncode
        if not timed_out:
            if mode == "ray":
                job_status = _ray_job_status(head, submission_id)
                status = "succeeded" if job_status == "SUCCEEDED" and returncode == 0 else "failed"
                detail = f"ray job {submission_id}: {job_status}"
            else:
                status = "succeeded" if returncode == 0 else "failed"
        log.write(f"# rlk launcher: {status} (exit code {returncode}) {detail}\n")
    peaks: dict[int, float] = {}
    if poller is not None:
        peaks = poller.stop()
    return ArmResult(cmd, mode, status, returncode, log_path, time.monotonic() - start, argv, peaks,
                     nvml_reason, detail, list(head.argv) if head else [])


def _pump(proc: subprocess.Popen, log, *, deadline: float) -> bool:
    """Copy the process output to the log until it exits; True if the deadline passed first.

    Reads the pipe's fd directly: a buffered readline would pull several lines into Python's
    buffer where select() no longer sees them, and they would reach the log only at the end.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            if not selector.select(timeout=min(remaining, 1.0)):
                if proc.poll() is not None:
                    break  # exited; a leftover child may still hold the pipe open
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            log.write(decoder.decode(chunk))
            log.flush()
        log.write(decoder.decode(b"", final=True))
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        selector.close()
