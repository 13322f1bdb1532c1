"""vime stdout parser against line fixtures in vime's real format (vime-facts.md, "Metrics")."""

from __future__ import annotations

import math

import pytest

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.engines.vime.log import (
    VimeLogError,
    parse_metric_dict,
    parse_vime_lines,
    parse_vime_log,
)


def test_baseline_fixture_both_perf_lines_merge_by_key(fixtures_dir):
    log = parse_vime_log(fixtures_dir / "vime_30b_a3b_baseline.log")
    assert not log.malformed
    assert sorted(log.records["perf"]) == [0, 1, 2]
    perf0 = log.records["perf"][0]
    # one key from the rollout manager's line, the rest from the trainer's line
    assert perf0["perf/rollout_time"] == 47.69 and perf0["perf/step_time"] == 97.0
    assert perf0["perf/ref_log_probs_time"] == 12.98 and "perf/update_weights_time" not in perf0
    assert log.records["perf"][1]["perf/update_weights_time"] == pytest.approx(2.42)
    assert log.records["eval"][3] == {"eval/dapo-math-17k": 0.31}
    series = log.series()
    assert series[m.STEP_TIME] == [97.0, 95.9, 96.3]
    assert series[m.ABS_DIFF][0] == 0.011258
    assert series[m.UPDATE_WEIGHTS_TIME] == [2.42, 2.43]  # no sync before the first rollout
    assert m.FALLBACK_COUNT not in series


def test_kernel_fixture_fallback_count_and_provider_evidence(fixtures_dir):
    log = parse_vime_log(fixtures_dir / "vime_30b_a3b_kernels.log")
    series = log.series()
    assert series[m.FALLBACK_COUNT] == [0.0, 0.0, 0.0]
    assert series[m.ENTROPY_LOSS] == [0.0, 0.0, 0.0]
    assert len(log.provider_active_lines) == 1 and not log.fallback_lines


@pytest.mark.parametrize("prefix", [
    "",
    "(MegatronTrainRayActor pid=48213) ",
    "\x1b[36m(RolloutManager pid=1, ip=10.0.0.12)\x1b[0m ",
    "(_RayTrainGroup pid=7) ",
])
def test_ray_prefixes_and_log_prefix_are_stripped(prefix):
    line = prefix + "[2026-11-20 03:12:10] model.py:655 - step 4: {'train/loss': np.float64(-0.5), 'train/kl_loss': 1e-09}"
    log = parse_vime_lines([line + " [repeated 3x across cluster]"])
    assert log.records["step"][4] == {"train/loss": -0.5, "train/kl_loss": 1e-9}


def test_numpy_reprs_nan_and_plain_numbers():
    values = parse_metric_dict("{'a': np.float64(1.5), 'b': np.float32(-2), 'c': 3, 'd': nan, 'e': -inf, 'f': np.int64(4)}")
    assert values["a"] == 1.5 and values["b"] == -2.0 and values["c"] == 3.0 and values["f"] == 4.0
    assert math.isnan(values["d"]) and values["e"] == -math.inf


@pytest.mark.parametrize("text, reason", [
    ("{'a': np.float64(1.0)", "not a Python dict"),
    ("{'a': 'fast'}", "non-numeric value"),
    ("[1, 2]", "not a dict"),
    ("{'a': __import__('os').system('true')}", "unsupported expression"),
    ("{1: 2.0}", "non-string key"),
])
def test_malformed_dicts_are_refused_with_a_reason(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_metric_dict(text)


def test_malformed_lines_and_a_run_that_died_midway(fixtures_dir):
    path = fixtures_dir / "vime_30b_a3b_malformed_died.log"
    log = parse_vime_log(path)
    assert [b.lineno for b in log.malformed] and len(log.malformed) == 3
    assert "step 2" in log.malformed[0].reason and "not a Python dict" in log.malformed[0].reason
    assert "non-numeric" in log.malformed[1].reason
    assert len(log.fallback_lines) == 1 and "context parallel" in log.fallback_lines[0]
    series = log.series()  # what was logged before the crash stays usable
    assert len(series[m.RAW_REWARD]) == 2
    with pytest.raises(VimeLogError, match=r"vime_30b_a3b_malformed_died.log: line \d+: step 2"):
        parse_vime_log(path, strict=True)


def test_conflicting_values_across_the_two_perf_lines_are_flagged():
    log = parse_vime_lines(["perf 0: {'perf/step_time': 1.0}", "perf 0: {'perf/step_time': 2.0}"])
    assert "conflicting values" in log.malformed[0].reason
    assert log.records["perf"][0] == {"perf/step_time": 1.0}


def test_metrics_present_at_some_rollouts_are_kept_as_gaps():
    log = parse_vime_lines(["rollout 0: {'rollout/raw_reward': 0.1}", "rollout 1: {'rollout/kl': 0.0}",
                            "rollout 2: {'rollout/raw_reward': 0.3, 'rollout/kl': 0.1}"])
    series = log.series()
    assert series[m.RAW_REWARD][0] == 0.1 and math.isnan(series[m.RAW_REWARD][1]) and series[m.RAW_REWARD][2] == 0.3
    assert math.isnan(series[m.ROLLOUT_KL][0]) and series[m.ROLLOUT_KL][1:] == [0.0, 0.1]
    assert log.gaps() == {m.RAW_REWARD: [1], m.ROLLOUT_KL: [0]}


def test_a_gated_gap_is_a_problem_naming_metric_arm_and_rollout_others_are_notes():
    from pytest_rlk.e2e.arms import ArmCommand
    from pytest_rlk.e2e.engines.vime.engine import gap_findings

    arm = ArmCommand(role="kernels", label="vime+kernels", lane="replay", argv=["python3"], env={})
    problems, notes = gap_findings(arm, {m.LOSS: [3], m.RESPONSE_LENGTH: [0, 1]})
    assert problems == ["vime+kernels (replay lane): gated metric 'loss' missing at rollouts [3]"]
    assert len(notes) == 1 and repr(m.RESPONSE_LENGTH) in notes[0] and "not gated" in notes[0]


def test_expected_lines_that_never_came_and_the_replay_arm_without_a_rollout_manager_line():
    trainer_only = ["rollout 0: {'rollout/log_probs': -0.3}", "step 0: {'train/loss': 0.1}",
                    "perf 0: {'perf/train_time': 9.0}", "rollout 1: {'rollout/log_probs': -0.3}",
                    "perf 1: {'perf/train_time': 9.0}"]
    log = parse_vime_lines(trainer_only)
    assert log.missing_lines(replays_rollouts=True) == ["1 trainer 'step' line(s) missing at rollouts 1"]
    assert log.missing_lines() == [
        "1 trainer 'step' line(s) missing at rollouts 1",
        "rollout manager 'perf N' line (perf/rollout_time) missing at rollouts 0-1"]


def test_async_prefix_and_critic_steps():
    log = parse_vime_lines([
        "[2026-11-20 03:12:10 fully-async-0] train_metric_utils.py:135 - rollout 2: {'rollout/raw_reward': 1.0}",
        "[2026-11-20 03:12:11] model.py:960 - critic-step 4: {'train/critic-loss': 0.5}"])
    assert log.records["rollout"][2] == {"rollout/raw_reward": 1.0}
    assert log.records["critic-step"][4] == {"train/critic-loss": 0.5} and not log.records["step"]


def test_train_steps_average_within_their_rollout():
    lines = [f"step {i}: {{'train/loss': {float(i)}}}" for i in range(4)]
    assert parse_vime_lines(lines).series(steps_per_rollout=2)[m.LOSS] == [0.5, 2.5]


def test_a_line_that_starts_like_a_metric_line_but_cannot_be_read_is_reported(fixtures_dir):
    """vime's real format with one line that announces `step 1` metrics but is no `step 1: {...}` line:
    the rest is read, the line is reported (count and the first few), strict parsing fails on it."""
    path = fixtures_dir / "vime_30b_a3b_unreadable.log"
    log = parse_vime_log(path)
    assert log.series()[m.FALLBACK_COUNT] == [0.0, 0.0, 0.0]  # every real metric line still read
    unreadable = log.unreadable()
    assert unreadable["count"] == 1 and len(unreadable["first"]) == 1
    assert "step 1: starts like a metric line" in unreadable["first"][0] and "<object object" in unreadable["first"][0]
    with pytest.raises(VimeLogError, match=r"vime_30b_a3b_unreadable.log: line 13: step 1: starts like a metric line"):
        parse_vime_log(path, strict=True)


def test_unreadable_lines_are_all_counted_and_the_first_few_quoted():
    lines = [f"step {i} note: {{'x': <object at 0x7f>}}" for i in range(5)] + ["step 9 finished without metrics"]
    unreadable = parse_vime_lines(lines).unreadable()
    assert unreadable["count"] == 5 and len(unreadable["first"]) == 3  # a line without a dict announces none
