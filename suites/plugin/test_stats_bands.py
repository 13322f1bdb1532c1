"""Unit tests of window aggregation and the default bands (no pytest machinery involved)."""
from __future__ import annotations

import pytest

from pytest_rlk.bands import DEFAULT_BANDS, default_band, default_window, metric_kind
from pytest_rlk.compare import compare_value
from pytest_rlk.schema import Band, Window
from pytest_rlk.stats import aggregate, percentile


def test_percentile_matches_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(list(range(101)), 90) == pytest.approx(90.0)


@pytest.mark.parametrize(("agg", "expected"), [
    ("mean", 2.0), ("median", 2.0), ("last", 3.0), ("min", 1.0), ("max", 3.0),
    ("p90", 2.8), ("p99", 2.98),
])
def test_aggregate_skips_warmup(agg, expected):
    assert aggregate([100.0, 1.0, 2.0, 3.0], Window(skip=1, agg=agg)) == pytest.approx(expected)


def test_aggregate_empty_window_names_metric():
    with pytest.raises(ValueError, match="'step_time'.*skips 3.*only 2"):
        aggregate([1.0, 2.0], Window(skip=3), name="step_time")


def test_band_width_is_max_of_rel_and_floor():
    band = Band(rel=0.2, abs_floor=0.05)
    assert band.width(1.0) == pytest.approx(0.2)
    assert band.width(0.1) == pytest.approx(0.05)
    assert band.width(-10.0) == pytest.approx(2.0)


def test_every_default_band_has_a_source():
    assert all(b.source for b in DEFAULT_BANDS.values())


@pytest.mark.parametrize(("name", "space", "kind", "rel", "floor"), [
    ("step_time_s", "time", "time", 0.15, 0.0),
    ("peak_mem", "memory", "memory", 0.10, 0.0),
    ("raw_reward", "reward", "reward", 0.2, 0.05),
    ("ppo_kl", "none", "logprob_diff", 0.5, 0.02),
    ("train_rollout_logp_abs_diff", "logprob", "logprob_diff", 0.5, 0.02),
    ("loss", "loss", "loss", 0.01, 0.0),
    ("tokens_per_s", "throughput", "throughput", 0.10, 0.0),
    ("logp_max_abs_err", "logprob", "error", 1.0, 0.0),
])
def test_default_band_per_kind(name, space, kind, rel, floor):
    assert metric_kind(name, space) == kind
    band = default_band(name, space)
    assert (band.rel, band.abs_floor) == (pytest.approx(rel), pytest.approx(floor))


def test_time_series_default_to_median_after_warmup():
    assert default_window("time") == Window(skip=1, agg="median")
    assert default_window("loss") == Window()


@pytest.mark.parametrize(("ref_ms", "new_ms", "verdict"), [
    (0.003936, 0.005056, "pass"),  # ratio_kl's no-grad call at [1] on unchanged code
    (0.003936, 0.0070, "regression"),  # past the 2 us floor
    (0.030, 0.0330, "pass"),  # logp's call at [64]: 15% of 0.030 is wider than the floor
    (0.030, 0.0350, "regression"),
])
def test_the_launch_time_band_holds_launch_spacing_and_fails_past_it(ref_ms, new_ms, verdict):
    result = compare_value("rlk_ms", ref_ms, new_ms, direction="lower_is_better", band=DEFAULT_BANDS["launch_time"])
    assert result.verdict == verdict, result.detail


def test_the_plain_time_band_fails_launch_spacing():
    """What made the gate fail on unchanged code: ratio_kl's call at [1], 1.1 us over its baseline."""
    result = compare_value("rlk_ms", 0.003936, 0.005056, direction="lower_is_better", band=DEFAULT_BANDS["time"])
    assert result.verdict == "regression"
