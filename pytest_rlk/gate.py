"""The per-test gate: compare a finished test's metrics with its baseline, update baselines.

``--rlk-update-baselines=failed`` rewrites only baselines that fail (regressed or missing
metrics, a missing file) or are out of date (new metrics, metrics no longer gated) and the test
still fails if it failed; ``=all`` rewrites every baseline
a test touches and the gate passes. In a failed-mode rewrite, metrics that passed keep their old
reference, so a rewrite never drifts values that were fine. A written file holds the recording run as a
one-run history (pytest_rlk.history) and its bands as the test states them (``rests_on`` None):
it gates from its first run. A case whose baseline has a band resting on fewer than
``bands.NOISE_RULE.min_runs`` trusted runs gates in shadow mode: its regressions are reported
(``GateResult.shadow``, the summary) and do not fail the test; a non-finite value does.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pytest_rlk import storage
from pytest_rlk.compare import baseline_metric_from, compare_to_baseline
from pytest_rlk.history import one_run_history
from pytest_rlk.options import UPDATE_MODES
from pytest_rlk.schema import (BASELINE_SCHEMA_VERSION, Baseline, GateResult, PlatformInfo, RunManifest, RunRecord,
                               TestRecord, Verdict)

UNTIERED = "untiered"
_REWRITE_IN_FAILED_MODE = (Verdict.REGRESSION, Verdict.MISSING_METRIC, Verdict.MISSING_BASELINE,
                           Verdict.NEW_METRIC, Verdict.UNGATED)


@dataclass
class GateSettings:
    baselines: Path
    platform: str
    update: str | None = None  # None | "failed" | "all"
    require: bool = False
    refresh_rel: float | None = None
    fail_on_improvement: bool = False


@dataclass
class GateOutcome:
    result: GateResult
    failure: str | None  # the message the test fails with; None when it passes


def gate_test(record: TestRecord, settings: GateSettings, provenance: dict[str, object]) -> GateOutcome:
    tier = record.tier or UNTIERED
    path = storage.baseline_path(settings.baselines, tier, settings.platform, record.case)
    baseline = None
    if path.exists():
        try:
            baseline = storage.load_baseline(path, tier=tier, platform=settings.platform, case=record.case)
        except storage.RlkFileError:
            if settings.update != "all":  # =all is the documented way to replace a bad file
                raise
    result = compare_to_baseline(record, baseline, refresh_rel=settings.refresh_rel)
    result.baseline_path = str(path)

    problems = [f"{c.name}: {c.verdict.label}: baseline {c.baseline:.6g}, new {c.new:.6g} ({c.detail})"
                if c.baseline is not None and c.new is not None else f"{c.name}: {c.verdict.label} ({c.detail})"
                for c in result.failing]
    if settings.fail_on_improvement and not result.shadow:
        problems += [f"{c.name}: {c.verdict.label}: baseline {c.baseline:.6g}, new {c.new:.6g} "
                     f"({c.detail}; --rlk-fail-on-improvement)" for c in result.improvements]
    if settings.require and result.missing_baseline:
        problems.append(f"no baseline at {path} (--rlk-require-baselines); record one with "
                        "--rlk-update-baselines=failed")

    if settings.update == "all" or (settings.update == "failed" and (problems or _needs_rewrite(result))):
        keep_old = settings.update == "failed" and baseline is not None
        _write(path, record, tier, settings, provenance, result, baseline if keep_old else None)
        result.baseline_written = True
    if settings.update == "all":
        problems = []
    if not problems:
        return GateOutcome(result, None)
    written = f"\n  baseline rewritten: {path}" if result.baseline_written else ""
    return GateOutcome(result, f"rlk gate failed for case {record.case!r} ({path}):\n  "
                       + "\n  ".join(problems) + written)


def _needs_rewrite(result: GateResult) -> bool:
    return bool(result.with_verdict(*_REWRITE_IN_FAILED_MODE))


def _write(path: Path, record: TestRecord, tier: str, settings: GateSettings,
           provenance: dict[str, object], result: GateResult, old: Baseline | None) -> None:
    verdicts = {c.name: c.verdict for c in result.comparisons}
    metrics = {}
    for m in record.metrics:
        if not m.gate:
            continue
        if old is not None and m.name in old.metrics and verdicts.get(m.name) not in _REWRITE_IN_FAILED_MODE \
                and not (settings.fail_on_improvement and verdicts.get(m.name) is Verdict.IMPROVED):
            metrics[m.name] = old.metrics[m.name]
        else:
            metrics[m.name] = baseline_metric_from(m)
    provenance = {**provenance, "nodeid": record.nodeid,
                  **({"kernel_backend_ids": list(record.backends)} if record.backends else {})}
    storage.write_baseline(path, Baseline(
        schema_version=BASELINE_SCHEMA_VERSION, tier=tier, case=record.case, platform=settings.platform,
        provenance=provenance, metrics=metrics, history=one_run_history(provenance, metrics, old)))


def provenance_of(manifest: RunManifest, platform: PlatformInfo) -> dict[str, object]:
    """What a baseline written from a run says of where its values come from."""
    return {"run_id": manifest.run_id, "created_utc": manifest.created_utc, "suite_commit": manifest.suite_commit,
            "suite_dirty": manifest.suite_dirty, "vime_commit": manifest.vime_commit,
            "kernel_backend_ids": manifest.kernel_backend_ids,
            "software": {k: v for k, v in manifest.software.items() if v is not None},
            "platform": platform.model_dump(exclude={"devices"})}


class UpdateError(ValueError):
    """A run that cannot write the baselines asked of it (the message names what and why)."""


def _matches(test: TestRecord, pattern: str) -> bool:
    return fnmatch.fnmatchcase(test.case, pattern) or fnmatch.fnmatchcase(test.nodeid, pattern)


def update_from_run(run: RunRecord, baselines: Path, *, mode: str,
                    cases: Sequence[str] = ()) -> list[GateOutcome]:
    """``--rlk-update-baselines=MODE`` applied to a recorded run's tests, without running them
    again: the same writer, the run's own manifest as the provenance. ``cases``: glob patterns on
    the case or the node id (none: every gated test). Only passed tests of real cases write: a
    selected case that failed, or one whose test runs an injected fault, is an error."""
    if mode not in UPDATE_MODES:
        raise UpdateError(f"unknown mode {mode!r}; valid modes: {', '.join(UPDATE_MODES)}")
    gated = [t for t in run.tests if any(m.gate for m in t.metrics)]
    chosen = [t for t in gated if not cases or any(_matches(t, c) for c in cases)]
    unmatched = [c for c in cases if not any(_matches(t, c) for t in gated)]
    if unmatched:
        raise UpdateError(f"no gated test of run {run.manifest.run_id} matches {', '.join(map(repr, unmatched))}")
    bad = [f"{t.nodeid} ({t.outcome})" for t in chosen if t.outcome != "passed"]
    bad += [f"{t.nodeid} (injected fault: {t.injected_fault})" for t in chosen if t.injected_fault]
    if bad:
        raise UpdateError("only a real case that passed can write its baseline: " + "; ".join(bad))
    platform = run.manifest.platform
    provenance = provenance_of(run.manifest, platform)
    return [gate_test(t, GateSettings(baselines=baselines, platform=t.gated_platform(platform.tag), update=mode),
                      provenance) for t in chosen]
