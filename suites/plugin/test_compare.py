"""Unit tests of the comparison engine (pytest_rlk.compare) on hand-built records."""
from __future__ import annotations

import math

import pytest

from pytest_rlk.compare import (
    baseline_metric_from,
    compare_records,
    compare_to_baseline,
    compare_value,
    scalar_value,
)
from pytest_rlk.schema import SCHEMA_VERSION, Band, Baseline, MetricRecord, TestRecord, Verdict

BAND = Band(rel=0.1, abs_floor=0.01)


@pytest.mark.parametrize(("direction", "new", "verdict"), [
    ("lower_is_better", 1.05, Verdict.PASS),
    ("lower_is_better", 1.2, Verdict.REGRESSION),
    ("lower_is_better", 0.8, Verdict.IMPROVED),
    ("higher_is_better", 0.95, Verdict.PASS),
    ("higher_is_better", 0.8, Verdict.REGRESSION),
    ("higher_is_better", 1.2, Verdict.IMPROVED),
    ("two_sided", 1.09, Verdict.PASS),
    ("two_sided", 0.8, Verdict.REGRESSION),
    ("two_sided", 1.2, Verdict.REGRESSION),
])
def test_compare_value_directions(direction, new, verdict):
    c = compare_value("m", 1.0, new, direction=direction, band=BAND)
    assert c.verdict is verdict
    assert c.delta == pytest.approx(new - 1.0)
    assert c.band_width == pytest.approx(0.1)


def test_abs_floor_dominates_near_zero():
    assert compare_value("err", 0.0, 0.009, direction="lower_is_better", band=BAND).verdict is Verdict.PASS
    assert compare_value("err", 0.0, 0.011, direction="lower_is_better", band=BAND).verdict is Verdict.REGRESSION


def test_refresh_rel_sets_the_improvement_band():
    wide = compare_value("t", 1.0, 0.85, direction="lower_is_better", band=BAND, refresh_rel=0.2)
    narrow = compare_value("t", 1.0, 0.85, direction="lower_is_better", band=BAND, refresh_rel=0.05)
    assert wide.verdict is Verdict.PASS and narrow.verdict is Verdict.IMPROVED
    assert narrow.verdict.label == "improved (refresh the baseline)"


def test_nan_is_a_regression():
    assert compare_value("m", 1.0, math.nan, direction="two_sided", band=BAND).verdict is Verdict.REGRESSION


def _metric(name, value, direction="lower_is_better", **kw):
    return MetricRecord(name=name, value=value, direction=direction, **kw)


def _record(*metrics):
    return TestRecord(nodeid="t.py::test", case="case", tier="op", outcome="passed", metrics=list(metrics))


def _baseline(**metrics):
    return Baseline(schema_version=SCHEMA_VERSION, tier="op", case="case", platform="cpu",
                    metrics={k: baseline_metric_from(v) for k, v in metrics.items()})


def test_compare_to_baseline_verdicts():
    base = _baseline(a=_metric("a", 1.0, band=BAND), gone=_metric("gone", 2.0, band=BAND))
    rec = _record(_metric("a", 1.5), _metric("fresh", 3.0), _metric("ungated", 9.0, gate=False))
    result = compare_to_baseline(rec, base)
    verdicts = {c.name: c.verdict for c in result.comparisons}
    assert verdicts == {"a": Verdict.REGRESSION, "fresh": Verdict.NEW_METRIC, "gone": Verdict.MISSING_METRIC}
    assert {c.name for c in result.regressions} == {"a", "gone"}
    assert result.failed()


def test_a_metric_the_test_stops_gating_is_reported_not_failed():
    # e.g. a benchmark that now gates its CUDA-graph time: the baseline's gated wall time is
    # still recorded, ungated, and the graph time is new
    base = _baseline(wall=_metric("wall", 1.0, band=BAND))
    rec = _record(_metric("wall", 5.0, gate=False), _metric("graph", 0.9))
    result = compare_to_baseline(rec, base)
    by_name = {c.name: c for c in result.comparisons}
    assert {n: c.verdict for n, c in by_name.items()} == {"graph": Verdict.NEW_METRIC, "wall": Verdict.UNGATED}
    assert (by_name["wall"].baseline, by_name["wall"].new) == (1.0, 5.0)
    assert not result.failed() and result.regressions == []
    assert "no longer gated" in Verdict.UNGATED.label


def test_compare_to_missing_baseline():
    result = compare_to_baseline(_record(_metric("a", 1.0)), None)
    assert result.missing_baseline and not result.failed()


def test_series_are_compared_by_their_window():
    series = _metric("t", [10.0, 1.0, 1.0, 1.2], space="time")
    assert scalar_value(series) == pytest.approx(1.0)  # time default: skip 1, median
    base = _baseline(t=series)
    assert base.metrics["t"].window.agg == "median"
    slower = _metric("t", [10.0, 2.0, 2.0, 2.0], space="time")
    assert compare_to_baseline(_record(slower), base).regressions[0].name == "t"


def test_compare_records_ab():
    a = [_metric("loss", 1.0, space="loss"), _metric("only_a", 1.0)]
    b = [_metric("loss", 1.02, space="loss"), _metric("only_b", 1.0)]
    result = compare_records(a, b, {"loss": Band(rel=0.05)})
    verdicts = {c.name: c.verdict for c in result.comparisons}
    assert verdicts == {"loss": Verdict.PASS, "only_a": Verdict.MISSING_METRIC, "only_b": Verdict.NEW_METRIC}
    strict = compare_records(a[:1], b[:1])  # default loss band: rel 0.01
    assert strict.comparisons[0].verdict is Verdict.REGRESSION
