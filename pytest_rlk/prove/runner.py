"""Run the registry's faults against their real tests (one pytest subprocess per fault and size)
and judge them: caught (a test of the tier failed), and by how much (the margin).

The margin of a tier's run is the largest ratio of a failing test's recorded error to its band
(a gate comparison: how far past the band's edge, in band widths from the reference; an error
metric: the error over its tolerance). Below 1 the fault stayed inside every band; a fault
caught by an assertion or an exception that records no metric (a strict-mode fallback) has none.
A caught fault whose recorded errors stay within their bands (a strict-mode fallback, an
assertion on a value no metric records) shows no margin.
A clean run (no fault) of the same tests comes first: every test must pass it, or nothing a fault
run says would mean anything.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pytest_rlk import storage
from pytest_rlk.prove.inject import OPTION
from pytest_rlk.prove.registry import OP_BACKEND_ARGS, PYTEST_TIER, Fault
from pytest_rlk.schema import RunRecord, TestRecord, Verdict

RUN_TIMEOUT_S = 600
# the caller's kernel switches never reach the runs: each test sets what it needs
_DROPPED_ENV_PREFIXES = ("VIME_RL_KERNEL", "RLK_")


class ProveError(RuntimeError):
    """The proof cannot be judged: a case missing or skipped, a clean run failing, pytest crashing."""


@dataclass
class TierResult:
    tier: str
    caught: bool
    margin: float | None
    failed: list[str] = field(default_factory=list)
    detail: str = ""


@dataclass
class Row:
    fault: Fault
    size: float
    tier: str
    result: TierResult | None  # None: not served here (skip_reason)
    nominal: bool
    skip_reason: str = ""


def child_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED_ENV_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def run_pytest(nodeids: Sequence[str], tiers: Iterable[str], fault: str | None, root: Path,
               artifacts: Path, env: dict[str, str] | None = None) -> RunRecord:
    """One real pytest run of ``nodeids`` with ``fault`` (``NAME=SIZE``) behind rlk-triton, or none."""
    cmd = [sys.executable, "-m", "pytest", *nodeids, f"--rlk-tier={','.join(sorted(set(tiers)))}",
           "-p", "pytest_rlk.prove.inject", "-p", "no:cacheprovider", "-q", f"--rlk-artifacts={artifacts}",
           *OP_BACKEND_ARGS]
    if fault is not None:
        cmd.append(f"{OPTION}={fault}")
    try:
        done = subprocess.run(cmd, cwd=root, env={**child_env(root), **(env or {})}, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ProveError(f"pytest ran past {RUN_TIMEOUT_S} s: {' '.join(cmd)}") from None
    if done.returncode not in (0, 1):  # 1: tests failed; anything else: pytest could not run them
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise ProveError(f"pytest exited {done.returncode} ({' '.join(cmd)}):\n{tail}")
    return storage.load_run(storage.resolve_run_file("latest", artifacts))


def _ratio(test: TestRecord) -> float | None:
    ratios = []
    if test.gate is not None:
        for c in test.gate.comparisons:
            if c.verdict is Verdict.REGRESSION and c.band_width and c.delta is not None:
                ratios.append(abs(c.delta) / c.band_width)
    for m in test.metrics:
        if m.space == "error" and m.band is not None and m.band.abs_floor > 0 and isinstance(m.value, float):
            ratios.append(m.value / m.band.abs_floor)
    return max(ratios) if ratios else None


def judge(run: RunRecord, tier: str, nodeids: Sequence[str], *, clean: bool = False) -> TierResult:
    by_id = {t.nodeid: t for t in run.tests}
    missing = [n for n in nodeids if n not in by_id]
    if missing:
        raise ProveError(f"tier {tier}: not run (renamed or deselected?): {', '.join(missing)}")
    tests = [by_id[n] for n in nodeids]
    for t in tests:
        if t.outcome == "skipped":
            raise ProveError(f"tier {tier}: {t.nodeid} skipped ({t.skip_reason}): a skipped case proves nothing")
        if t.outcome == "error":
            raise ProveError(f"tier {tier}: {t.nodeid} errored outside its body: {(t.failure or '').splitlines()[:1]}")
    failed = [t for t in tests if t.outcome == "failed"]
    if clean and failed:
        raise ProveError(f"tier {tier}: the clean run (no fault) fails: {failed[0].nodeid}: "
                         f"{(failed[0].failure or '').splitlines()[:1]}; fix that first")
    ratios = [r for r in map(_ratio, failed or tests) if r is not None]
    margin = max(ratios) if ratios else None
    if failed and margin is not None and margin <= 1.0:
        margin = None  # failed by an assertion or an exception beside the recorded errors
    detail = ""
    if failed:
        first = (failed[0].failure or "").splitlines()
        detail = f"{failed[0].nodeid.split('::')[-1]}: {first[0][:90] if first else ''}"
    return TierResult(tier, bool(failed), margin, [t.nodeid for t in failed], detail)


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def prove(faults: Sequence[Fault], tiers: Sequence[str], root: Path, *, sizes: dict[str, float] | None = None,
          graded: bool = False, keep: Path | None = None, log=print) -> tuple[dict[str, TierResult], list[Row]]:
    """The clean run, then each fault at its nominal size (or ``sizes[name]``) and, with
    ``graded``, at each size of its ladder. Returns the clean run's results per tier and the rows."""
    gpu = has_gpu()
    served = [t for t in tiers if not (t.endswith("-gpu") and not gpu)]
    base = keep if keep is not None else Path(tempfile.mkdtemp(prefix="rlk-prove-"))
    rows: list[Row] = []
    plans = []
    for fault in faults:
        for tier in tiers:
            if tier not in fault.tiers or not fault.cases(tier):
                continue
            if tier not in served or (fault.needs_gpu and not gpu):
                rows.append(Row(fault, fault.size, tier, None, True, "needs a CUDA GPU"))
                continue
            plans.append((fault, tier))
    clean_ids = {tier: sorted({n for f, t in plans if t == tier for n in f.cases(t)}) for tier in served}
    clean_ids = {t: ids for t, ids in clean_ids.items() if ids}
    clean: dict[str, TierResult] = {}
    if clean_ids:
        log(f"rlk prove: clean run of {sum(map(len, clean_ids.values()))} tests ({', '.join(clean_ids)})")
        run = run_pytest([n for ids in clean_ids.values() for n in ids], (PYTEST_TIER[t] for t in clean_ids),
                         None, root, base / "clean")
        clean = {t: judge(run, t, ids, clean=True) for t, ids in clean_ids.items()}
    by_fault: dict[str, list[str]] = {}
    for fault, tier in plans:
        by_fault.setdefault(fault.name, []).append(tier)
    for fault in faults:
        fault_tiers = by_fault.get(fault.name, [])
        if not fault_tiers:
            continue
        nominal = (sizes or {}).get(fault.name, fault.size)
        ladder = [s for s in fault.ladder if s != nominal] if graded else []
        for size in [nominal, *ladder]:
            spec = f"{fault.name}={size:g}"
            log(f"rlk prove: {spec} on {', '.join(fault_tiers)}")
            ids = {t: fault.cases(t) for t in fault_tiers}
            run = run_pytest([n for t in fault_tiers for n in ids[t]], (PYTEST_TIER[t] for t in fault_tiers),
                             spec, root, base / spec, env=fault.env)
            for tier in fault_tiers:
                rows.append(Row(fault, size, tier, judge(run, tier, ids[tier]), size == nominal))
    return clean, rows


def smallest_caught(rows: Iterable[Row]) -> dict[tuple[str, str], float]:
    """(fault, tier) -> the smallest size caught."""
    found: dict[tuple[str, str], float] = {}
    for row in rows:
        if row.result is not None and row.result.caught:
            key = (row.fault.name, row.tier)
            found[key] = min(found.get(key, row.size), row.size)
    return found
