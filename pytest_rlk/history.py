"""Baselines with a history of trusted runs: bands recommended from measured noise, runs distrusted.

A baseline (schema 2) keeps, per case, the trusted runs it rests on and each gated metric's last
``NOISE_RULE.keep`` values with their statistics (``schema.CaseHistory``). A version-1 file loads
unchanged and reads as a one-run history: the run its provenance names, the references as values.

- :func:`recommend` (``rlk baselines recommend RUN...``): N >= ``NOISE_RULE.min_runs`` runs of the
  same cases on one platform -> per metric the mean, sd, min and max, and a band by
  ``NOISE_RULE`` around the mean, whose source names the runs, their dates and commits, and the rule.
- :func:`distrust` (``rlk baselines distrust RUN``): removes a run's values from every history that
  holds it; the bands that rested on it are recommended again from the runs left, and a case whose
  band then rests on fewer than ``min_runs`` runs gates in shadow mode (``compare.shadow_reason``).

A band stated in code (a tolerance, a default band) has ``rests_on`` None and gates from its first
run, as every baseline ``--rlk-update-baselines`` writes does: shadow mode is for bands that rest on
measured runs and do not yet have enough of them.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from pytest_rlk import storage
from pytest_rlk.bands import NOISE_RULE
from pytest_rlk.compare import band_for, scalar_value, shadow_reason, window_for
from pytest_rlk.schema import (
    BASELINE_SCHEMA_VERSION,
    Band,
    Baseline,
    BaselineMetric,
    CaseHistory,
    GateResult,
    HistoryRun,
    MetricHistory,
    MetricRecord,
    MetricStats,
    RunRecord,
    TestRecord,
)

UNTIERED = "untiered"
GATE_FAILURE = "rlk gate failed"


class HistoryError(ValueError):
    """Runs that cannot make a band (too few, mixed platforms, non-finite values, ...): the message
    names the runs, cases and metrics at fault."""


# -- reading histories ------------------------------------------------------------------------------

def history_run(provenance: dict[str, object]) -> HistoryRun | None:
    run_id = provenance.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        return None
    commit = provenance.get("suite_commit")
    return HistoryRun(run_id=run_id, created_utc=str(provenance.get("created_utc") or ""),
                      suite_commit=commit if isinstance(commit, str) else None)


def case_history(baseline: Baseline) -> CaseHistory:
    """The baseline's history; a version-1 file's is one run (its provenance's), its references the
    values (none when the provenance names no run)."""
    if baseline.history is not None:
        return baseline.history
    run = history_run(baseline.provenance)
    if run is None:
        return CaseHistory(legacy=True)
    return CaseHistory(runs=[run], legacy=True, metrics={
        name: MetricHistory(values={run.run_id: m.ref}, stats=stats_of([m.ref]))
        for name, m in baseline.metrics.items()})


def stats_of(values: Sequence[float]) -> MetricStats:
    return MetricStats(n=len(values), mean=statistics.fmean(values),
                       sd=statistics.stdev(values) if len(values) > 1 else 0.0,
                       min=min(values), max=max(values))


# -- recommending bands from runs -------------------------------------------------------------------

@dataclass
class MetricRecommendation:
    name: str
    stats: MetricStats
    stated: Band
    band: Band

    @property
    def width(self) -> float:
        return self.band.abs_floor


@dataclass
class CaseRecommendation:
    tier: str
    platform: str
    case: str
    nodeid: str
    runs: list[HistoryRun]
    metrics: list[MetricRecommendation] = field(default_factory=list)
    baseline: Baseline | None = None  # what is written
    path: Path | None = None
    dropped: list[str] = field(default_factory=list)  # in the old baseline, recorded by no run


def noise_band(stats: MetricStats, stated: Band, runs: Sequence[HistoryRun]) -> Band:
    """``NOISE_RULE``'s band around the mean of ``runs``' values, its source naming them."""
    width = NOISE_RULE.width(stats.mean, stats.sd, stated.abs_floor)
    plural = "s" if len(runs) != 1 else ""
    named = ", ".join(r.describe() for r in runs)
    return Band(abs_floor=width, rests_on=len(runs), source=(
        f"{len(runs)} run{plural}: {named}; rule {NOISE_RULE.describe()} (pytest_rlk.bands.NOISE_RULE), "
        f"sd {stats.sd:.4g}, stated band {stated.describe()}"))


def _trusted_tests(path: Path, run: RunRecord) -> dict[tuple[str, str, str], TestRecord]:
    if run.partial:
        raise HistoryError(f"run {run.manifest.run_id} ({path}) is {run.describe_status()}: a band rests "
                           "on complete runs only")
    platform = run.manifest.platform.tag
    tests = {}
    for test in run.tests:
        if not any(m.gate for m in test.metrics):
            continue
        gate_only = test.outcome == "failed" and (test.failure or "").startswith(GATE_FAILURE)
        if test.outcome != "passed" and not gate_only:
            why = (test.failure or "no message").splitlines()[0]
            raise HistoryError(
                f"run {run.manifest.run_id}: test {test.nodeid} {test.outcome} ({why}); only a test that "
                "passed, or failed by its rlk gate alone, measures its case's noise: leave this run out "
                "or rerun it")
        tests[(test.tier or UNTIERED, test.gated_platform(platform), test.case)] = test
    return tests


def recommend(runs: Sequence[tuple[Path, RunRecord]], baselines: Path) -> list[CaseRecommendation]:
    """Per case of the runs, each gated metric's statistics and its recommended band (nothing written)."""
    if len(runs) < NOISE_RULE.min_runs:
        raise HistoryError(f"{len(runs)} run{'s' if len(runs) != 1 else ''} given: a band rests on at least "
                           f"{NOISE_RULE.min_runs} runs of the same cases (NOISE_RULE.min_runs)")
    ids = [run.manifest.run_id for _, run in runs]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise HistoryError(f"run {', '.join(repeated)} given more than once")
    platforms = {run.manifest.platform.tag for _, run in runs}
    if len(platforms) > 1:
        listed = ", ".join(f"{run.manifest.run_id}: {run.manifest.platform.tag}" for _, run in runs)
        raise HistoryError(f"the runs are of {len(platforms)} platforms ({listed}): a band is per platform; "
                           "give runs of one platform")
    ordered = sorted(runs, key=lambda pr: pr[1].manifest.created_utc)
    per_run = [(run, _trusted_tests(path, run)) for path, run in ordered]
    cases = sorted(set().union(*(tests.keys() for _, tests in per_run)))
    if not cases:
        raise HistoryError("the runs hold no gated metric")
    out = []
    for key in cases:
        lacking = [run.manifest.run_id for run, tests in per_run if key not in tests]
        if lacking:
            raise HistoryError(f"case {key[2]} (tier {key[0]}, platform {key[1]}) is in some runs but not in "
                               f"{', '.join(lacking)}: give runs of the same cases")
        out.append(_recommend_case(key, [(run, tests[key]) for run, tests in per_run], baselines))
    return out


def _recommend_case(key: tuple[str, str, str], tests: list[tuple[RunRecord, TestRecord]],
                    baselines: Path) -> CaseRecommendation:
    tier, platform, case = key
    runs = [HistoryRun(run_id=r.manifest.run_id, created_utc=r.manifest.created_utc,
                       suite_commit=r.manifest.suite_commit) for r, _ in tests]
    latest = tests[-1][1]
    rec = CaseRecommendation(tier, platform, case, latest.nodeid, runs)
    path, old = storage.find_baseline(baselines, tier, platform, case)
    rec.path = path
    names = [m.name for m in latest.metrics if m.gate]
    metrics: dict[str, BaselineMetric] = {}
    hist = CaseHistory(runs=runs[-NOISE_RULE.keep:])
    for name in names:
        values = []
        for run, test in tests:
            found = [m for m in test.metrics if m.name == name and m.gate]
            if not found:
                raise HistoryError(f"case {case}: metric {name} is gated in {latest.nodeid} of the newest run "
                                   f"but not recorded (gated) in run {run.manifest.run_id}")
            value = scalar_value(found[0])
            if not math.isfinite(value):
                raise HistoryError(f"run {run.manifest.run_id}: case {case}: metric {name} is {value}: a non-finite "
                                   "value is an error, never a measurement of noise")
            values.append(value)
        kept = values[-NOISE_RULE.keep:]
        kept_runs = runs[-NOISE_RULE.keep:]
        stats = stats_of(kept)
        metric = next(m for m in latest.metrics if m.name == name and m.gate)
        stated = band_for(metric)
        band = noise_band(stats, stated, kept_runs)
        rec.metrics.append(MetricRecommendation(name, stats, stated, band))
        metrics[name] = _baseline_metric(metric, stats.mean, band)
        hist.metrics[name] = MetricHistory(values=dict(zip((r.run_id for r in kept_runs), kept)), stats=stats,
                                           stated=stated)
    if old is not None:
        rec.dropped = sorted(set(old.metrics) - set(metrics))
        hist.distrusted = case_history(old).distrusted
    provenance = dict(old.provenance) if old is not None else {"nodeid": latest.nodeid}
    provenance["bands_recommended_utc"] = _now()
    rec.baseline = Baseline(schema_version=BASELINE_SCHEMA_VERSION, tier=tier, case=case, platform=platform,
                            provenance=provenance, metrics=metrics, history=hist)
    return rec


def _baseline_metric(metric: MetricRecord, ref: float, band: Band) -> BaselineMetric:
    return BaselineMetric(ref=ref, unit=metric.unit, direction=metric.direction, space=metric.space,
                          band=band, window=window_for(metric))


def write_recommendations(recs: Iterable[CaseRecommendation]) -> list[Path]:
    written = []
    for rec in recs:
        assert rec.path is not None and rec.baseline is not None
        storage.write_baseline(rec.path, rec.baseline)
        written.append(rec.path)
    return written


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- distrusting a run ------------------------------------------------------------------------------

@dataclass
class Distrusted:
    path: Path
    shadow: bool  # the case now gates in shadow mode


def distrust(run_id: str, baselines: Path) -> list[Distrusted]:
    """Remove ``run_id``'s values from every baseline history under ``baselines`` and write the
    files back; a band that rested on it is recommended again from the runs left (``rests_on`` the
    count left, 0 when none is), so a case left with fewer than ``min_runs`` gates in shadow mode."""
    changed = []
    for path in sorted(baselines.rglob("*.json")):
        baseline = storage.load_baseline(path)
        hist = case_history(baseline)
        gone = [r for r in hist.runs if r.run_id == run_id]
        if not gone:
            continue
        runs = [r for r in hist.runs if r.run_id != run_id]
        metrics = {}
        histories = {}
        for name, metric in baseline.metrics.items():
            mh = hist.metrics.get(name, MetricHistory())
            values = {r: v for r, v in mh.values.items() if r != run_id}
            if run_id not in mh.values:
                metrics[name], histories[name] = metric, mh
                continue
            left = [r for r in runs if r.run_id in values]
            stated = mh.stated or metric.band
            if values:
                stats = stats_of(list(values.values()))
                band = noise_band(stats, stated, left)
                metrics[name] = metric.model_copy(update={"ref": stats.mean, "band": band})
                histories[name] = MetricHistory(values=values, stats=stats, stated=stated)
            else:
                band = metric.band.model_copy(update={
                    "rests_on": 0, "source": f"{metric.band.source}; its only run {run_id} is distrusted"})
                metrics[name] = metric.model_copy(update={"band": band})
                histories[name] = MetricHistory(stated=stated)
        new = baseline.model_copy(update={
            "schema_version": BASELINE_SCHEMA_VERSION, "metrics": metrics,
            "history": CaseHistory(runs=runs, distrusted=[*hist.distrusted, *gone], metrics=histories)})
        storage.write_baseline(path, new)
        changed.append(Distrusted(path, shadow_reason(new) is not None))
    if not changed:
        raise HistoryError(f"run {run_id} is in no baseline's history under {baselines}")
    return changed


# -- what the gate writes ---------------------------------------------------------------------------

def one_run_history(provenance: dict[str, object], metrics: dict[str, BaselineMetric],
                    old: Baseline | None) -> CaseHistory:
    """The history ``--rlk-update-baselines`` writes: the recording run's values; a metric kept from
    ``old`` (failed mode) keeps its history there."""
    run = history_run(provenance)
    old_hist = case_history(old) if old is not None else CaseHistory()
    hist = CaseHistory(distrusted=old_hist.distrusted)
    used: set[str] = set()
    for name, metric in metrics.items():
        kept = old is not None and old.metrics.get(name) is metric
        if kept and name in old_hist.metrics:
            hist.metrics[name] = old_hist.metrics[name]
            used |= set(old_hist.metrics[name].values)
        elif run is not None:
            hist.metrics[name] = MetricHistory(values={run.run_id: metric.ref}, stats=stats_of([metric.ref]))
            used.add(run.run_id)
    known = {r.run_id: r for r in old_hist.runs}
    if run is not None:
        known[run.run_id] = run
    hist.runs = [r for r in known.values() if r.run_id in used]
    return hist


# -- what the summary and `rlk diff` print ----------------------------------------------------------

def shadow_lines(results: Iterable[GateResult]) -> list[str]:
    """One line per case gating in shadow mode, with the verdicts that would fail it."""
    lines = []
    for r in results:
        if r.shadow is None:
            continue
        would = [f"{c.name} {c.verdict.value}" for c in r.regressions]
        verdict = f"would fail: {', '.join(would)}" if would else "would pass"
        lines.append(f"  shadow: {r.case}: {verdict} ({r.shadow}; exit unaffected)")
    if lines:
        lines.insert(0, f"shadow mode: {len(lines)} case{'s' if len(lines) > 1 else ''} (verdicts reported, "
                     "regressions do not fail; a non-finite value does)")
    return lines


def band_source_lines(results: Iterable[GateResult]) -> list[str]:
    """Each band resting on runs once, with its case and metrics: which runs it came from."""
    by_source: dict[tuple[str, str], list[str]] = {}
    for r in results:
        for c in r.comparisons:
            if c.band is not None and c.band.rests_on is not None:
                by_source.setdefault((r.case, c.band.source.split("; rule")[0]), []).append(c.name)
    return [f"band source: {case}: {', '.join(names)}: {source}" for (case, source), names in by_source.items()]
