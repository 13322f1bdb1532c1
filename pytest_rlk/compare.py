"""THE comparison engine: metrics vs a baseline, or run A vs run B, with bands and verdicts.

Used by the plugin's gate, ``rlk diff`` and the e2e A/B gates alike.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from pytest_rlk.bands import NOISE_RULE, default_band, default_window
from pytest_rlk.schema import (
    Band,
    Baseline,
    BaselineMetric,
    GateResult,
    MetricComparison,
    MetricRecord,
    TestRecord,
    Verdict,
    Window,
)
from pytest_rlk.stats import aggregate

__all__ = [
    "GateResult", "MetricComparison", "Verdict", "band_for", "window_for", "scalar_value",
    "compare_value", "compare_to_baseline", "compare_records", "baseline_metric_from", "shadow_reason",
]


def band_for(metric: MetricRecord) -> Band:
    return metric.band if metric.band is not None else default_band(metric.name, metric.space)


def window_for(metric: MetricRecord) -> Window | None:
    if not metric.is_series:
        return None
    return metric.window if metric.window is not None else default_window(metric.space)


def scalar_value(metric: MetricRecord) -> float:
    """The number a metric is gated on: the value, or the window aggregate of a series."""
    if isinstance(metric.value, list):
        return aggregate(metric.value, window_for(metric), name=metric.name)
    return metric.value


def compare_value(name: str, ref: float, new: float, *, direction: str, band: Band,
                  refresh_rel: float | None = None) -> MetricComparison:
    """One metric: regression outside the band on the bad side, improved beyond the refresh band.

    The refresh band is ``max(refresh_rel * |ref|, band.abs_floor)`` when ``refresh_rel`` is
    given, else the metric's own band. Two-sided metrics have no "better" side.
    """
    width = band.width(ref)
    delta = new - ref
    refresh = band.width(ref) if refresh_rel is None else max(refresh_rel * abs(ref), band.abs_floor)
    verdict, detail = Verdict.PASS, ""
    if not math.isfinite(new):  # NaN or inf is never within a band, in shadow mode neither
        verdict, detail = Verdict.REGRESSION, f"value is not finite ({new})"
    elif direction == "two_sided":
        if abs(delta) > width:
            verdict = Verdict.REGRESSION
            detail = f"|delta| {abs(delta):.4g} > band {width:.4g}"
    else:
        worse = -delta if direction == "higher_is_better" else delta  # > 0 means worse
        if worse > width:
            verdict = Verdict.REGRESSION
            detail = f"worse by {worse:.4g} > band {width:.4g}"
        elif -worse > refresh:
            verdict = Verdict.IMPROVED
            detail = f"better by {-worse:.4g} > refresh band {refresh:.4g}"
    return MetricComparison(name=name, baseline=ref, new=new, delta=delta, band_width=width,
                            band=band, direction=direction, verdict=verdict, detail=detail)


def compare_to_baseline(test_record: TestRecord, baseline: Baseline | None, *,
                        refresh_rel: float | None = None) -> GateResult:
    """Gate a test's gated metrics against its baseline (None: every metric is missing_baseline).

    The baseline's band and window are authoritative: the values were recorded under them.
    """
    gated = [m for m in test_record.metrics if m.gate]
    result = GateResult(case=test_record.case, shadow=shadow_reason(baseline))
    if baseline is None:
        for m in gated:
            result.comparisons.append(MetricComparison(
                name=m.name, new=_safe_scalar(m), direction=m.direction,
                verdict=Verdict.MISSING_BASELINE, detail="no baseline file"))
        return result
    by_name = {m.name: m for m in gated}
    for name, m in by_name.items():
        ref = baseline.metrics.get(name)
        if ref is None:
            result.comparisons.append(MetricComparison(
                name=name, new=_safe_scalar(m), direction=m.direction,
                verdict=Verdict.NEW_METRIC, detail="not in the baseline"))
            continue
        new = _scalar_under(m, ref)
        result.comparisons.append(compare_value(
            name, ref.ref, new, direction=ref.direction, band=ref.band, refresh_rel=refresh_rel))
    ungated = {m.name: m for m in test_record.metrics if not m.gate}
    for name, ref in baseline.metrics.items():
        if name in by_name:
            continue
        if name in ungated:
            result.comparisons.append(MetricComparison(
                name=name, baseline=ref.ref, new=_safe_scalar(ungated[name]), direction=ref.direction,
                verdict=Verdict.UNGATED, detail="in the baseline; recorded, but its test no longer gates it"))
        else:
            result.comparisons.append(MetricComparison(
                name=name, baseline=ref.ref, direction=ref.direction,
                verdict=Verdict.MISSING_METRIC, detail="in the baseline but not recorded"))
    return result


def compare_records(a_metrics: Iterable[MetricRecord] | Mapping[str, MetricRecord],
                    b_metrics: Iterable[MetricRecord] | Mapping[str, MetricRecord],
                    bands: Mapping[str, Band] | None = None, *, case: str = "A/B",
                    refresh_rel: float | None = None) -> GateResult:
    """A/B: A is the reference, B the candidate. Bands: ``bands[name]``, else B's (or A's) own."""
    a = _by_name(a_metrics)
    b = _by_name(b_metrics)
    bands = bands or {}
    result = GateResult(case=case)
    for name, mb in b.items():
        ma = a.get(name)
        if ma is None:
            result.comparisons.append(MetricComparison(
                name=name, new=_safe_scalar(mb), direction=mb.direction,
                verdict=Verdict.NEW_METRIC, detail="only in B"))
            continue
        band = bands.get(name) or mb.band or ma.band or default_band(name, mb.space)
        result.comparisons.append(compare_value(
            name, scalar_value(ma), scalar_value(mb), direction=mb.direction, band=band,
            refresh_rel=refresh_rel))
    for name, ma in a.items():
        if name not in b:
            result.comparisons.append(MetricComparison(
                name=name, baseline=_safe_scalar(ma), direction=ma.direction,
                verdict=Verdict.MISSING_METRIC, detail="only in A"))
    return result


def shadow_reason(baseline: Baseline | None) -> str | None:
    """Why a case gates in shadow mode, or None: some band of its baseline rests on fewer trusted
    runs than ``NOISE_RULE.min_runs`` (a band recommended from runs, or one whose run was
    distrusted). A band stated in code (``rests_on`` None) gates from the first run."""
    if baseline is None:
        return None
    short = {name: m.band.rests_on for name, m in baseline.metrics.items()
             if m.band.rests_on is not None and m.band.rests_on < NOISE_RULE.min_runs}
    if not short:
        return None
    runs = sorted(set(short.values()))
    counts = "/".join(str(n) for n in runs)
    return (f"bands rest on {counts} trusted run{'s' if runs != [1] else ''} "
            f"(fewer than {NOISE_RULE.min_runs}): {', '.join(sorted(short))}")


def baseline_metric_from(metric: MetricRecord) -> BaselineMetric:
    """What ``--rlk-update-baselines`` stores for a recorded metric."""
    return BaselineMetric(ref=scalar_value(metric), unit=metric.unit, direction=metric.direction,
                          space=metric.space, band=band_for(metric), window=window_for(metric))


def _scalar_under(metric: MetricRecord, ref: BaselineMetric) -> float:
    if isinstance(metric.value, list):
        window = ref.window or window_for(metric)
        return aggregate(metric.value, window, name=metric.name)
    return metric.value


def _safe_scalar(metric: MetricRecord) -> float | None:
    try:
        return scalar_value(metric)
    except ValueError:
        return None


def _by_name(metrics: Iterable[MetricRecord] | Mapping[str, MetricRecord]) -> dict[str, MetricRecord]:
    if isinstance(metrics, Mapping):
        return dict(metrics)
    return {m.name: m for m in metrics}
