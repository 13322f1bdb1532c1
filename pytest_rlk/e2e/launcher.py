"""The launcher: runs one arm's command to completion or timeout, safely, for every engine.

Two modes share the log / timeout / teardown code:
- `local`: the command runs directly as a subprocess (the TRL engine, tests, vime without Ray);
- `ray`: the arm gets a Ray head of its own (`ray_head.RayHead`) and the command goes to it with
  `ray job submit` (the upstream way of starting vime).

Every process starts in a session of its own; teardown ends only that session's processes
(`processes.end_session`). The full output streams to a log file that is kept, line by line to an
optional `on_line` callback (progress); a failure message carries the log's tail. The arm's
environment is the caller's without any kernel-switch variable (`VIME_RL_KERNEL*`: only the spec
decides which arm runs the kernels) plus the command's own.
"""

from __future__ import annotations

import codecs
import os
import selectors
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pytest_rlk.e2e.arms import ArmCommand
from pytest_rlk.e2e.nvml import NvmlPeakPoller, NvmlUnavailable
from pytest_rlk.e2e.processes import TAIL_LINES, LaunchError, end_session, tail
from pytest_rlk.e2e.ray_head import (
    RAY_LOOPBACK_ENV, RayHead, job_submit_argv, ray_job_status, ray_start_argv, stop_ray_job,
)
from pytest_rlk.e2e.spec import KERNEL_ENV_SWITCH

LaunchMode = Literal["ray", "local"]
ArmStatus = Literal["succeeded", "failed", "timeout"]
LineCallback = Callable[[str], None]
ARM_LOG = "arm.log"


@dataclass(frozen=True)
class LaunchConfig:
    """How an engine's arms are launched (chosen by the engine's `prepare`)."""

    mode: LaunchMode = "local"
    ray_bin: str = "ray"
    head_gpus: int = 0
    head_start_s: float = 120.0
    poll_memory: bool = False  # NVML peak memory per GPU while the arm runs


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


def inherited_environment() -> dict[str, str]:
    """The caller's environment without kernel switches: an arm runs the kernels only when its
    command says so."""
    return {k: v for k, v in os.environ.items() if not k.startswith(KERNEL_ENV_SWITCH)}


def command_lines(cmd: ArmCommand, config: LaunchConfig, *, name: str, result: ArmResult | None = None) -> list[str]:
    """The shell lines that run `cmd`: with `result`, what ran (real ports); without, the plan."""
    if result is not None and result.mode == "ray":
        return [shlex.join(result.head_argv), shlex.join(result.launch_argv)]
    if config.mode == "ray" and result is None:
        head = ray_start_argv(None, f"<own temp dir>/{name}", config.head_gpus, ray_bin=config.ray_bin)
        submit = job_submit_argv(cmd, "http://127.0.0.1:<dashboard-port>", f"rlk-{name}", config.ray_bin)
        return [shlex.join(head), shlex.join(submit)]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(cmd.full_env.items()))
    return [f"cd {shlex.quote(cmd.workdir or '.')} && env {env} {shlex.join(cmd.argv)}"]


def launch_arm(cmd: ArmCommand, *, arm_dir: Path, config: LaunchConfig, timeout_s: float,
               on_line: LineCallback | None = None) -> ArmResult:
    """Run one arm with its output in `arm_dir/arm.log`; in ray mode under a Ray head of its own
    (its log in `arm_dir/ray_head.log`), stopped afterwards whatever happened."""
    log_path = arm_dir / ARM_LOG
    if config.mode == "local":
        return run_arm(cmd, log_path=log_path, timeout_s=timeout_s, mode="local",
                       poll_memory=config.poll_memory, on_line=on_line)
    head = RayHead.start(num_gpus=config.head_gpus, log_dir=arm_dir, timeout_s=config.head_start_s,
                         ray_bin=config.ray_bin, env=inherited_environment())
    try:
        return run_arm(cmd, log_path=log_path, timeout_s=timeout_s, mode="ray", head=head,
                       poll_memory=config.poll_memory, on_line=on_line)
    finally:
        head.stop()


def run_arm(
    cmd: ArmCommand,
    *,
    log_path: Path,
    timeout_s: float,
    mode: LaunchMode,
    head: RayHead | None = None,
    poll_memory: bool = False,
    on_line: LineCallback | None = None,
) -> ArmResult:
    """Run one arm to completion or timeout; the full output goes to `log_path` (kept).

    Never raises for a failing job: the result says what happened (call `raise_for_status`), so
    the caller can still read the partial output.
    """
    if mode == "ray" and head is None:
        raise ValueError("run_arm(mode='ray') needs the RayHead to submit to")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    submission_id = f"rlk-{cmd.role}-{cmd.lane}-{os.getpid()}-{int(time.time() * 1000)}"
    if mode == "ray":
        argv = job_submit_argv(cmd, head.dashboard_url, submission_id, head.ray_bin)
        env, cwd = {**os.environ, **RAY_LOOPBACK_ENV}, None
    else:
        argv, env, cwd = list(cmd.argv), {**inherited_environment(), **cmd.full_env}, cmd.workdir
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
        timed_out = _pump(proc, log, deadline=start + timeout_s, on_line=on_line)
        if timed_out:
            status, detail = "timeout", f"timed out after {timeout_s:.0f}s"
            if mode == "ray":
                stop_ray_job(head, submission_id)
        end_session(proc)
        returncode = proc.returncode
        if not timed_out:
            if mode == "ray":
                job_status = ray_job_status(head, submission_id)
                status = "succeeded" if job_status == "SUCCEEDED" and returncode == 0 else "failed"
                detail = f"ray job {submission_id}: {job_status}"
            else:
                status = "succeeded" if returncode == 0 else "failed"
        log.write(f"# rlk launcher: {status} (exit code {returncode}) {detail}\n")
    peaks = poller.stop() if poller is not None else {}
    return ArmResult(cmd, mode, status, returncode, log_path, time.monotonic() - start, argv, peaks,
                     nvml_reason, detail, list(head.argv) if head else [])


class _Lines:
    """Splits streamed text into lines for the `on_line` callback."""

    def __init__(self, on_line: LineCallback | None) -> None:
        self.on_line, self.pending = on_line, ""

    def feed(self, text: str) -> None:
        if self.on_line is None:
            return
        *complete, self.pending = (self.pending + text).split("\n")
        for line in complete:
            self.on_line(line)

    def close(self) -> None:
        if self.on_line is not None and self.pending:
            self.on_line(self.pending)
        self.pending = ""


def _pump(proc: subprocess.Popen, log, *, deadline: float, on_line: LineCallback | None = None) -> bool:
    """Copy the process output to the log until it exits; True if the deadline passed first.

    Reads the pipe's fd directly: a buffered readline would pull several lines into Python's
    buffer where select() no longer sees them, and they would reach the log only at the end.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    lines = _Lines(on_line)
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
            text = decoder.decode(chunk)
            log.write(text)
            log.flush()
            lines.feed(text)
        text = decoder.decode(b"", final=True)
        log.write(text)
        lines.feed(text)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        lines.close()
        selector.close()
