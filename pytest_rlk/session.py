"""Run directories: per-process part files and the controller's merge into ``run.json``.

Every pytest process (each xdist worker, or the single process without xdist) rewrites its own
``parts/<worker>.json`` atomically after each test. The controller writes a ``running`` header
``run.json`` at session start and merges the parts into it at session end. A run that never
reached session end keeps status ``running`` on disk; ``rlk merge`` then marks it ``crashed``.

``latest`` moves to a run when it records its first test result, so a run that selected nothing
or stopped before any test (a typo in ``-m``, a usage error, Ctrl-C during collection) never
hides the last run with results from ``rlk diff latest``.
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from pytest_rlk import storage
from pytest_rlk.manifest import kernel_backend_ids, kernel_fallback_counts, utc_now
from pytest_rlk.schema import PartFile, RunManifest, RunRecord, RunStatus, TestRecord

PARTS = "parts"
ALL_GPU_WORKER = "all-gpus"  # the part file (and TestRecord.worker) of the all-GPU phase
TESTS = "tests"
FILES = "files"


def start_run(artifacts: Path, manifest: RunManifest) -> Path:
    run_dir = artifacts / manifest.run_id
    (run_dir / PARTS).mkdir(parents=True, exist_ok=True)
    storage.write_run(run_dir, RunRecord(manifest=manifest, status="running",
                                         host=socket.gethostname(), pid=os.getpid()))
    return run_dir


class PartWriter:
    """One process's records, flushed to ``parts/<worker>.json`` after every change."""

    def __init__(self, run_dir: Path, worker: str) -> None:
        self.run_dir = run_dir
        self.path = run_dir / PARTS / f"{worker}.json"
        self.part = PartFile(worker=worker)

    @property
    def tests_dir(self) -> Path:
        return self.run_dir / TESTS

    def add(self, test: TestRecord) -> None:
        self.part.tests.append(test)
        self.flush()
        if len(self.part.tests) == 1:  # this run has a result now: it becomes `latest`
            storage.set_latest(self.run_dir.parent, self.run_dir)

    def set_deselected(self, counts: dict[str, int]) -> None:
        self.part.deselected = dict(counts)
        self.flush()

    def add_file(self, description: str, path: Path) -> None:
        self.part.files[description] = str(path)
        self.flush()

    def set_collected(self, n: int) -> None:
        self.part.collected = n
        self.flush()

    def flush(self) -> None:
        self.part.fallback_counts = kernel_fallback_counts()
        self.part.kernel_backend_ids = kernel_backend_ids()
        storage.write_json_atomic(self.path, self.part)


def merge_run(run_dir: Path, *, status: RunStatus | None = None,
              exit_status: int | None = None) -> RunRecord:
    """Merge every part into ``run.json``. Idempotent: the parts stay the source of truth.

    Without ``status``, a run whose header still says ``running`` is ``crashed`` unless its
    controller process is still alive on this host (then it stays ``running``).
    """
    header = storage.load_run(run_dir / storage.RUN_FILE)
    parts = [storage.load_part(p) for p in sorted((run_dir / PARTS).glob("*.json"))]
    # a module skipped at collection is recorded by every xdist worker that collected it: once here
    tests = list({t.nodeid: t for part in reversed(parts) for t in reversed(part.tests)}.values())[::-1]
    deselected: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    # every xdist worker collects the same tests (less those held back); the all-GPU phase
    # collects those held back
    shared = [p.collected for p in parts if p.collected is not None and p.worker != ALL_GPU_WORKER]
    held = [p.collected for p in parts if p.collected is not None and p.worker == ALL_GPU_WORKER]
    collected = None if not shared and not held else max(shared, default=0) + sum(held)
    files = {k: v for part in parts for k, v in part.files.items()}
    backend_ids = list(header.manifest.kernel_backend_ids)
    for part in parts:
        for tier, n in part.deselected.items():  # every worker collects the same tests
            deselected[tier] = max(deselected.get(tier, 0), n)
        for op, n in part.fallback_counts.items():
            fallbacks[op] = fallbacks.get(op, 0) + n
        backend_ids.extend(b for b in part.kernel_backend_ids if b not in backend_ids)
    exercised = list(dict.fromkeys(b for t in tests for b in t.backends))
    manifest = header.manifest.model_copy(update={
        # what the tests exercised; without such records, what kernels.backend_id() said
        "kernel_backend_ids": exercised or backend_ids,
        "seeds": {t.nodeid: dict(t.seeds) for t in tests if t.seeds},
    })
    final_status = status or header.status
    if final_status == "running" and not _controller_alive(header):
        final_status = "crashed"
    run = RunRecord(
        manifest=manifest, status=final_status, host=header.host, pid=header.pid,
        finished_utc=utc_now() if status else header.finished_utc,
        exit_status=exit_status if exit_status is not None else header.exit_status,
        tests=tests, deselected=deselected, fallback_counts=fallbacks, collected=collected, files=files,
    )
    storage.write_run(run_dir, run)
    return run


def discard_run_without_results(run_dir: Path) -> bool:
    """Remove a run directory no test result reached (a usage error found while collecting);
    True when removed. A run with any result, or files the tests wrote, is kept."""
    parts = [storage.load_part(p) for p in sorted((run_dir / PARTS).glob("*.json"))]
    if any(part.tests or part.files for part in parts) or (run_dir / TESTS).exists() or (run_dir / FILES).exists():
        return False
    shutil.rmtree(run_dir)
    return True


def _controller_alive(header: RunRecord) -> bool:
    if header.pid is None or header.host != socket.gethostname():
        return False
    try:
        os.kill(header.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class RunFiles:
    """Files of the whole run (not of one test): ``DIR/<run_id>/files/<name>``, each named with
    its description in the rlk summary and the report (e.g. a table several tests fill)."""

    def __init__(self, state) -> None:  # the plugin's RlkState: its run_dir and writer
        self._state = state

    def path(self, name: str, description: str) -> Path:
        if self._state.run_dir is None:
            raise RuntimeError("rlk_files.path: this run writes no artifacts")
        path = self._state.run_dir / FILES / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._state.writer is not None:
            self._state.writer.add_file(description, path)
        return path
