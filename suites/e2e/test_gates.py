"""Engine-agnostic A/B gates on per-arm series (fixtures parsed from vime's format, and edits)."""

from __future__ import annotations

import pytest

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.gates import gate_lane, pair_verdict
from pytest_rlk.e2e.spec import GateSelection, ReplayHorizon
from pytest_rlk.e2e.engines.vime.log import parse_vime_log
from pytest_rlk.schema import Verdict


@pytest.fixture
def arms(fixtures_dir):
    base = parse_vime_log(fixtures_dir / "vime_30b_a3b_baseline.log").series()
    kern = parse_vime_log(fixtures_dir / "vime_30b_a3b_kernels.log").series()
    return base, kern


def _live(base, kern, **kw):
    return gate_lane(base, kern, case="qwen3-30b", platform="h200", lane="live", skip_warmup=1, **kw)


def _verdicts(lane):
    return {c.name: c.verdict for c in lane.gate.comparisons}


def test_real_format_pair_passes(arms):
    lane = _live(*arms, baseline_scalars={m.PEAK_VRAM: 64363.0}, kernels_scalars={m.PEAK_VRAM: 64363.0})
    assert lane.passed, lane.failures()
    verdicts = _verdicts(lane)
    assert verdicts[m.RAW_REWARD] is Verdict.PASS and verdicts[m.ABS_DIFF] is Verdict.PASS
    assert verdicts[m.FALLBACK_COUNT] is Verdict.PASS and verdicts[m.PEAK_VRAM] is Verdict.PASS
    assert m.ENTROPY_LOSS not in verdicts and any("entropy_loss" in n for n in lane.notes)
    pair = pair_verdict([lane])
    assert pair.passed and "PASS" in pair.summary()


def test_injected_raw_reward_drop_fails(arms):
    base, kern = arms
    kern = {**kern, m.RAW_REWARD: [v - 0.1 for v in kern[m.RAW_REWARD]]}
    lane = _live(base, kern)
    assert not lane.passed and _verdicts(lane)[m.RAW_REWARD] is Verdict.REGRESSION
    assert not pair_verdict([lane]).passed


def test_raw_reward_drop_inside_the_miles_band_passes(arms):
    base, kern = arms
    kern = {**kern, m.RAW_REWARD: [v - 0.04 for v in kern[m.RAW_REWARD]]}  # abs floor 0.05
    assert _verdicts(_live(base, kern))[m.RAW_REWARD] is Verdict.PASS


def test_injected_abs_diff_rise_fails(arms):
    base, kern = arms
    kern = {**kern, m.ABS_DIFF: [v + 0.03 for v in kern[m.ABS_DIFF]]}
    lane = _live(base, kern)
    assert _verdicts(lane)[m.ABS_DIFF] is Verdict.REGRESSION
    assert any("train_rollout_logprob_abs_diff" in f for f in lane.failures())


@pytest.mark.parametrize("fallbacks, events", [([0.0, 2.0, 0.0], 0), ([0.0, 0.0, 0.0], 1)])
def test_nonzero_fallback_count_fails_even_in_warmup(arms, fallbacks, events):
    base, kern = arms
    kern = {**kern, m.FALLBACK_COUNT: fallbacks}
    lane = _live(base, kern, kernel_fallback_events=events)
    assert _verdicts(lane)[m.FALLBACK_COUNT] is Verdict.REGRESSION and not lane.passed


def test_missing_fallback_count_fails(arms):
    base, kern = arms
    kern = {k: v for k, v in kern.items() if k != m.FALLBACK_COUNT}
    assert _verdicts(_live(base, kern))[m.FALLBACK_COUNT] is Verdict.MISSING_METRIC


def test_entropy_is_never_compared(arms):
    base, kern = arms
    assert base[m.ENTROPY_LOSS][0] > 0.1 and kern[m.ENTROPY_LOSS][0] == 0.0
    for lane_name in ("live", "replay"):
        lane = gate_lane(base, kern, case="c", platform="h200", lane=lane_name, skip_warmup=1)
        assert not any(c.name.startswith(m.ENTROPY_LOSS) for c in lane.gate.comparisons)


def test_warmup_rollouts_are_skipped(arms):
    base, kern = arms
    slow_first = {**kern, m.STEP_TIME: [500.0] + kern[m.STEP_TIME][1:]}
    assert _verdicts(_live(base, slow_first))[m.STEP_TIME] is not Verdict.REGRESSION
    slow_later = {**kern, m.STEP_TIME: kern[m.STEP_TIME][:2] + [500.0]}
    slow_later = {**slow_later, m.STEP_TIME: [v * 1.3 for v in slow_later[m.STEP_TIME]]}
    assert _verdicts(_live(base, slow_later))[m.STEP_TIME] is Verdict.REGRESSION


def test_speed_and_memory_gates_follow_the_spec_selection(arms):
    base, kern = arms
    slow = {**kern, m.STEP_TIME: [v * 2 for v in kern[m.STEP_TIME]]}
    lane = _live(base, slow, gates=GateSelection(speed=False, memory=False),
                 baseline_scalars={m.PEAK_VRAM: 1000.0}, kernels_scalars={m.PEAK_VRAM: 5000.0})
    assert lane.passed and m.STEP_TIME not in _verdicts(lane) and m.PEAK_VRAM not in _verdicts(lane)
    lane = _live(base, kern, baseline_scalars={m.PEAK_VRAM: 1000.0}, kernels_scalars={m.PEAK_VRAM: 1200.0})
    assert _verdicts(lane)[m.PEAK_VRAM] is Verdict.REGRESSION  # Megatron: +10%


def test_replay_lane_compares_every_step(arms):
    base, _ = arms
    kern = {**base, m.FALLBACK_COUNT: [0.0] * 3}
    lane = gate_lane(base, kern, case="c", platform="h200", lane="replay", skip_warmup=1)
    assert lane.passed and {f"{m.LOSS}[0]", f"{m.GRAD_NORM}[2]", f"{m.LOG_PROBS}[1]"} <= set(_verdicts(lane))
    assert m.RAW_REWARD not in _verdicts(lane)  # same samples: reward is not a replay signal
    drift = {**kern, m.GRAD_NORM: [0.41, 0.39, 0.46]}
    lane = gate_lane(base, drift, case="c", platform="h200", lane="replay", skip_warmup=1)
    assert _verdicts(lane)[f"{m.GRAD_NORM}[2]"] is Verdict.REGRESSION and not lane.passed


def test_replay_horizon_gates_its_steps_and_reports_the_rest(arms):
    """Past the horizon the arms train on weights that have parted: reported, not gated."""
    base, _ = arms
    far = {**base, m.FALLBACK_COUNT: [0.0] * 3, m.GRAD_NORM: [base[m.GRAD_NORM][0], 9.0, 9.0]}
    horizon = ReplayHorizon(steps=1, source="measured: the arms part after step 0")
    lane = gate_lane(base, far, case="c", platform="h200", lane="replay", skip_warmup=1, replay_horizon=horizon)
    assert lane.passed, lane.failures()
    assert f"{m.GRAD_NORM}[0]" in _verdicts(lane) and f"{m.GRAD_NORM}[1]" not in _verdicts(lane)
    assert any("replay steps 1..2 reported, not gated (horizon 1 steps: measured" in n for n in lane.notes)
    wrong_first = {**far, m.GRAD_NORM: [base[m.GRAD_NORM][0] * 1.5, 9.0, 9.0]}
    lane = gate_lane(base, wrong_first, case="c", platform="h200", lane="replay", skip_warmup=1,
                     replay_horizon=horizon)
    assert _verdicts(lane)[f"{m.GRAD_NORM}[0]"] is Verdict.REGRESSION and not lane.passed


def test_an_arm_with_fewer_rollouts_fails(arms):
    base, kern = arms
    short = {k: v[:2] for k, v in kern.items()}
    for lane_name in ("live", "replay"):
        lane = gate_lane(base, short, case="c", platform="h200", lane=lane_name, skip_warmup=1)
        assert _verdicts(lane)["rollouts_completed"] is Verdict.REGRESSION


def test_empty_window_fails_instead_of_passing(arms):
    base, kern = arms
    lane = gate_lane(base, kern, case="c", platform="h200", lane="live", skip_warmup=3)
    assert _verdicts(lane)["window"] is Verdict.MISSING_METRIC and not lane.passed


def test_ragged_series_are_refused(arms):
    base, kern = arms
    with pytest.raises(ValueError, match="series lengths differ"):
        _live(base, {**kern, m.RAW_REWARD: [0.0]})


def test_every_gated_metric_states_its_band_source():
    for policy in m.E2E_METRICS.values():
        if policy.gated:
            assert policy.band.source, policy.name
