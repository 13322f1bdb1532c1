"""One node's pytest job: run pytest, send its run files as they are written, stop it at timeout.

This runs on the node (inside a Ray task, see ``ray_driver.py``) but is plain Python, testable
without Ray: :func:`run_node_job` is a generator of messages, each a small dict:

- ``{"kind": "started", "host", "pid", "argv", "utc"}``
- ``{"kind": "files", "tar": bytes}``: the files of the job's directory written or changed
  since the last message (the run dir ``runs/<run_id>/`` and ``pytest.log``); pytest writes its
  part file after every test, atomically, so what arrives is always readable;
- ``{"kind": "finished", "exit_status", "timed_out", "run_dir", "utc"}`` or
  ``{"kind": "not_started", "detail"}``.

Whatever the node sent before it died is on the driver already: a node that dies keeps the
tests it finished.
"""
from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pytest_rlk import storage
from pytest_rlk.e2e.processes import die_with_parent, end_session, pythonpath_first
from pytest_rlk.manifest import utc_now
from pytest_rlk.session import merge_run

RUNS = "runs"
LOG_FILE = "pytest.log"


@dataclass(frozen=True)
class NodeJob:
    name: str
    pytest_args: list[str]  # without --rlk-artifacts (the job sets it)
    suite_root: str | None = None  # None: the current directory (Ray's shipped working_dir)
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 3600.0
    sync_interval_s: float = 30.0
    stop_grace_s: float = 60.0


class FileSync:
    """Packs the files under ``root`` that are new or changed since the last call."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sent: dict[str, tuple[int, int]] = {}

    def changed(self) -> bytes | None:
        buf = io.BytesIO()
        count = 0
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for path in sorted(self.root.rglob("*")):
                rel = path.relative_to(self.root).as_posix()
                # atomic writers' temp files and the `latest` link are not run files
                if path.is_symlink() or not path.is_file() or any(p.startswith(".") for p in rel.split("/")):
                    continue
                try:
                    stat = path.stat()
                    key = (stat.st_mtime_ns, stat.st_size)
                    if self.sent.get(rel) == key:
                        continue
                    data = path.read_bytes()
                except FileNotFoundError:
                    continue  # replaced or removed while we looked: the next call sends it
                info = tarfile.TarInfo(rel)
                info.size, info.mtime, info.mode = len(data), int(stat.st_mtime), 0o644
                tar.addfile(info, io.BytesIO(data))
                self.sent[rel] = key
                count += 1
        return buf.getvalue() if count else None


def unpack_files(data: bytes, dest: Path) -> list[str]:
    """Write the files of a :meth:`FileSync.changed` archive under ``dest`` (each atomically);
    names that would leave ``dest`` are refused."""
    written = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if not member.isfile() or Path(member.name).is_absolute() or ".." in parts:
                raise ValueError(f"refusing archive member {member.name!r} (not a plain relative file)")
            extracted = tar.extractfile(member)
            assert extracted is not None  # a regular file
            target = dest / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.part")
            tmp.write_bytes(extracted.read())
            os.replace(tmp, target)
            written.append(member.name)
    return written


def stop_pytest(proc: subprocess.Popen, grace_s: float) -> None:
    """Ctrl-C first (pytest then finishes the run file as ``interrupted``), ``grace_s`` for it to
    end, then the rest of the job's session: SIGTERM, SIGKILL."""
    end_session(proc, grace_s=10.0, leader_first_s=grace_s, leader_signal=signal.SIGINT)


def newest_run_dir(runs: Path) -> Path | None:
    try:
        return runs / storage.resolve_run_dir(storage.LATEST, runs).name
    except storage.RlkFileError:
        return None


def run_node_job(job: NodeJob, work_dir: Path | None = None) -> Iterator[dict]:
    """Run the job's pytest under ``work_dir`` (default: a new temp dir, removed at the end)."""
    own_dir = work_dir is None
    work = Path(tempfile.mkdtemp(prefix=f"rlk-nightly-{job.name}-")) if own_dir else work_dir
    runs = work / RUNS
    cwd = Path(job.suite_root) if job.suite_root else Path.cwd()
    argv = [sys.executable, "-m", "pytest", *job.pytest_args, f"--rlk-artifacts={runs}"]
    env = {**os.environ, **job.env}
    env["PYTHONPATH"] = pythonpath_first(cwd, environ=env)
    yield {"kind": "started", "host": socket.gethostname(), "pid": os.getpid(), "argv": argv, "utc": utc_now()}
    sync = FileSync(work)
    proc = None
    try:
        with (work / LOG_FILE).open("wb") as log:
            try:
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=die_with_parent)
            except OSError as exc:
                yield {"kind": "not_started", "detail": f"{argv[0]} in {cwd}: {exc}"}
                return
            deadline = time.monotonic() + job.timeout_s
            timed_out = False
            while True:
                try:
                    proc.wait(timeout=max(0.0, min(job.sync_interval_s, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() >= deadline:
                    timed_out = True
                    stop_pytest(proc, job.stop_grace_s)
                    break
                files = sync.changed()
                if files:
                    yield {"kind": "files", "tar": files}
            end_session(proc, grace_s=5.0)  # whatever pytest left in its session
        run_dir = newest_run_dir(runs)
        if run_dir is not None:
            merge_run(run_dir)  # idempotent; a run whose pytest died is marked crashed
        files = sync.changed()
        if files:
            yield {"kind": "files", "tar": files}
        yield {"kind": "finished", "exit_status": proc.returncode, "timed_out": timed_out,
               "run_dir": run_dir.relative_to(work).as_posix() if run_dir else None, "utc": utc_now()}
    finally:
        if proc is not None and proc.poll() is None:  # the consumer went away (task cancelled)
            stop_pytest(proc, min(job.stop_grace_s, 10.0))
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
