"""Processes the launcher starts: each in a session of its own, ended by session id only.

vime's own test helper kills by broad name and runs `ray stop --force`, which would end other
users' clusters on a shared host. Here every process the launcher starts leads a new session
(`start_new_session=True`, so the session id is its pid); `end_session` finds that session's
processes through /proc and ends exactly those (SIGTERM, a grace period, SIGKILL), nothing else.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

LOOPBACK = "127.0.0.1"
TAIL_LINES = 60


class LaunchError(RuntimeError):
    """A Ray head or an arm could not run; the message names the log file and its tail."""


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    if not path.exists():
        return f"<{path} was not written>"
    with path.open(encoding="utf-8", errors="replace") as fh:
        return "".join(deque(fh, maxlen=lines)).rstrip("\n")


def pythonpath_first(*front: str | Path, environ: dict[str, str] | None = None) -> str:
    """PYTHONPATH for a child process that must import ``front`` first (this checkout, a vime tree,
    Megatron-LM) and still import what the caller's own PYTHONPATH provides (``environ``, default
    ``os.environ``): packages installed with ``pip --target``, a user's other checkouts. Replacing
    the caller's PYTHONPATH instead leaves the child without them (a ModuleNotFoundError in its
    log, not in the caller's)."""
    inherited = (os.environ if environ is None else environ).get("PYTHONPATH", "")
    entries = [str(p) for p in front] + [p for p in inherited.split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(entries))


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


def end_session(leader: subprocess.Popen, *, grace_s: float = 20.0, leader_first_s: float = 0.0,
                leader_signal: signal.Signals = signal.SIGTERM) -> list[int]:
    """End every process of the session `leader` started (it was started with
    start_new_session=True, so the session id is its pid): SIGTERM, wait, SIGKILL. Returns the
    pids that were signalled. Touches nothing outside that session.

    `leader_first_s` > 0: SIGTERM the leader alone first and give it that long to end its own
    children in order (`ray start --block` does: ~6 s, where SIGTERM to every Ray process at once
    leaves the raylet respawning agents and waiting on the dead GCS for 30 s and more); whatever is
    left then gets the SIGTERM / `grace_s` / SIGKILL sequence. `leader_signal` is what the leader
    gets first (SIGINT for pytest: it then ends its run as interrupted and writes its files).
    """
    sid = leader.pid
    signalled: set[int] = set()
    if leader_first_s > 0 and leader.poll() is None:
        signalled.add(sid)
        _signal([sid], leader_signal)
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


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """A `preexec_fn` (between fork and exec): the child gets SIGTERM when the process that
    started it dies, so a killed parent (a Ray worker on a node that died) leaves nothing running;
    and the child hears a Ctrl-C that asks it to stop. Both a blocked SIGINT (Ray workers block it)
    and an ignored one (a shell without job control starts `cmd &` with SIGINT ignored: cron, nohup,
    CI scripts) survive exec, and a Python started with SIGINT ignored never installs its
    KeyboardInterrupt handler, so pytest would die by the later SIGTERM without ending its run."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        # libc's signal(), not signal.signal: this may run in a forked non-main thread
        _LIBC.signal(signal.SIGINT, 0)  # SIG_DFL
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
