"""The mismatch metrics, bands and step-0 identities (pytest_rlk/mismatch) on hand-computed numbers."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from kernels import tolerances
from pytest_rlk import mismatch
from pytest_rlk.mismatch import gates, identities
from pytest_rlk.mismatch.gates import markdown_table
from pytest_rlk.mismatch.metrics import METRIC_NAMES, MismatchError, mismatch_metrics

E = math.exp


def _known():
    # d = train - rollout over the active tokens = [0, -0.5, +0.5]; the 4th token is masked out
    train = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    rollout = torch.tensor([-1.0, -1.5, -1.0, -9.0])
    return train, rollout, torch.tensor([1, 1, 1, 0])


def test_every_metric_on_hand_computed_values():
    train, rollout, mask = _known()
    m = mismatch_metrics(train, rollout, mask, lengths=[2, 2])
    assert (m.active_tokens, m.samples) == (3, 2)
    assert m.logp_abs_mean == pytest.approx(1 / 3)
    assert m.logp_abs_max == pytest.approx(0.5)
    assert m.train_rollout_logprob_abs_diff == pytest.approx((0.25 + 0.5) / 2)  # samples [0, .5] and [.5]
    assert m.token_mult_prob_error == pytest.approx((1 + 2 * E(0.5)) / 3)
    assert m.prob_abs_mean == pytest.approx((0 + (E(-1.5) - E(-2.0)) + (E(-0.5) - E(-1.0))) / 3)
    assert m.kl_k3 == pytest.approx((0 + (E(-0.5) - 0.5) + (E(0.5) - 1.5)) / 3)
    w = [1.0, E(-0.5), E(0.5)]
    assert m.is_weight_mean == pytest.approx(sum(w) / 3)
    assert m.is_ess == pytest.approx(sum(w) ** 2 / (3 * sum(x * x for x in w)))
    assert m.is_capped_2 == 0.0 and m.is_capped_5 == 0.0
    assert list(m.values()) == list(METRIC_NAMES)


def test_cap_shares_and_equal_sides():
    # w = 3, 6, 1: a cap of 2 clips two of three tokens, a cap of 5 one
    train = torch.log(torch.tensor([0.6, 0.6, 0.5], dtype=torch.float64))
    rollout = torch.log(torch.tensor([0.2, 0.1, 0.5], dtype=torch.float64))
    m = mismatch_metrics(train, rollout)
    assert m.is_capped_2 == pytest.approx(2 / 3) and m.is_capped_5 == pytest.approx(1 / 3)
    assert m.samples == 1 and m.train_rollout_logprob_abs_diff == pytest.approx(m.logp_abs_mean)
    same = mismatch_metrics(rollout, rollout)
    assert (same.logp_abs_max, same.kl_k3, same.prob_abs_mean) == (0.0, 0.0, 0.0)
    assert (same.token_mult_prob_error, same.is_weight_mean, same.is_ess) == (1.0, 1.0, 1.0)


def test_a_batch_of_rows_is_its_samples():
    train, rollout, mask = _known()
    flat = mismatch_metrics(train, rollout, mask, lengths=[2, 2])
    rows = mismatch_metrics(train.view(2, 2), rollout.view(2, 2), mask.view(2, 2).bool())
    assert rows == flat


@pytest.mark.parametrize("call, message", [
    (lambda: mismatch_metrics(torch.zeros(3), torch.zeros(2)), r"train_logp shape \(3,\) != rollout_logp shape \(2,\)"),
    (lambda: mismatch_metrics(torch.zeros(2), torch.zeros(2), torch.tensor([1, 0.5])), "mask: values"),
    (lambda: mismatch_metrics(torch.zeros(2), torch.zeros(2), torch.zeros(2)), "no active token"),
    (lambda: mismatch_metrics(torch.zeros(2), torch.zeros(2), lengths=[1, 2]), "sum to the 2 tokens"),
    (lambda: mismatch_metrics(torch.tensor([0.0, float("nan")]), torch.zeros(2)), "train_logp: nan at flat token 1"),
    (lambda: mismatch_metrics(torch.zeros(2, dtype=torch.long), torch.zeros(2)), "expected floating-point"),
    (lambda: mismatch_metrics(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1)), "expected \\[tokens\\]"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(MismatchError, match=message):
        call()


def test_masked_non_finite_tokens_do_not_count():
    m = mismatch_metrics(torch.tensor([-1.0, float("-inf")]), torch.tensor([-1.0, -2.0]), torch.tensor([1, 0]))
    assert m.logp_abs_max == 0.0


def test_vimes_ceiling_is_a_default_band_and_fails_on_purpose():
    assert mismatch.VIME_ABS_DIFF_CEILING == 0.1 and "vime PR 94" in mismatch.VIME_ABS_DIFF_CEILING_SOURCE
    (ceiling,) = gates.VIME_CEILING_ONLY
    assert ceiling in gates.DEFAULT_BANDS and ceiling.high == 0.1
    base = mismatch_metrics(torch.tensor([-1.0, -1.0]), torch.tensor([-1.02, -0.99])).values()
    assert gates.band_problems(base) == []
    just_over = {**base, "train_rollout_logprob_abs_diff": 0.1001}
    (problem,) = gates.band_problems(just_over)
    assert problem.startswith("train_rollout_logprob_abs_diff 0.1001 outside") and "vime PR 94" in problem
    assert gates.band_problems({**base, "is_ess": 0.29}) == [
        "is_ess 0.29 outside is_ess >= 0.3 (verl rollout correction: ESS >= 0.3)"]
    assert "is_weight_mean 2.1 outside 0.5 <= is_weight_mean <= 2" in gates.band_problems({**base, "is_weight_mean": 2.1})[0]
    assert "not given" in gates.band_problems({"kl_k3": 0.0})[0]
    assert gates.band_problems({**base, "kl_k3": float("nan")})[0].startswith("kl_k3 nan outside")
    with pytest.raises(MismatchError, match="not a mismatch metric"):
        gates.MetricBand("abs_mean", None, 1.0, "x")


def test_every_step_within_the_band_not_only_the_mean():
    ok = {"train_rollout_logprob_abs_diff": 0.02}
    steps = [ok, ok, {"train_rollout_logprob_abs_diff": 0.15}, ok, ok, ok]
    # the mean over steps (0.0417) is within the ceiling; step 2 is not
    assert sum(s["train_rollout_logprob_abs_diff"] for s in steps) / len(steps) < 0.1
    (problem,) = gates.every_step_within(steps, gates.VIME_CEILING_ONLY)
    assert problem.startswith("step 2: train_rollout_logprob_abs_diff 0.15 outside")
    assert gates.every_step_within([ok] * 3, gates.VIME_CEILING_ONLY) == []
    with pytest.raises(MismatchError, match="no steps"):
        gates.every_step_within([])


def test_a_trl_lane_holds_its_token_mean_to_vimes_ceiling_on_every_step():
    logged = [{"sampling/sampling_logp_difference/mean": v, "sampling/sampling_logp_difference/max": 0.5,
               "loss": 1.0} for v in (0.01, 0.02, 0.12)]
    steps = [mismatch.from_logged(s) for s in logged]
    assert steps[0] == {"logp_abs_mean": 0.01, "logp_abs_max": 0.5}
    band = mismatch.vime_ceiling("logp_abs_mean")
    (problem,) = gates.every_step_within(steps, [band])
    assert problem.startswith("step 2: logp_abs_mean 0.12 outside logp_abs_mean <= 0.1") and "vime PR 94" in problem
    assert mismatch.vime_ceiling() is gates.DEFAULT_BANDS[0]


def test_step0_identities_within_the_ops_tolerance():
    tol = identities.step0_tolerance("fp32", "cpu")
    atol = tolerances.get("logp", "fp32", "cpu").atol
    assert tol.ppo_kl == atol and tol.kl_loss > tolerances.get("ratio_kl", "fp32", "cpu").atol
    assert identities.step0_problems(ppo_kl=0.0, kl_loss=0.0, ratio=1.0, tolerance=tol) == []
    assert identities.step0_problems(ppo_kl=0.5 * atol, ratio=math.exp(-0.5 * atol), tolerance=tol) == []
    # a kernel 1e-3 off: ppo_kl = -1e-3 and the ratio exp(1e-3) both fail; the KL, second order, does not
    problems = identities.step0_problems(ppo_kl=-1e-3, kl_loss=5e-7, ratio=math.exp(1e-3), tolerance=tol)
    assert [p.split(" fails")[0] for p in problems] == ["step-0 identity ppo_kl == 0", "step-0 identity ratio == 1"]
    assert "kernels/tolerances.py logp fp32" in problems[0]
    per_token = torch.zeros(5)
    per_token[3] = 2e-5
    (p,) = identities.step0_problems(ppo_kl=per_token, tolerance=tol)
    assert "2e-05 (worst of 5 tokens, at token 3)" in p
    exact = identities.exact_tolerance()
    assert identities.step0_problems(ppo_kl=2e-8, tolerance=exact)[0].endswith(f"({identities.SLIME_STEP0_SOURCE})")
    with pytest.raises(MismatchError, match="at least one"):
        identities.step0_problems()


def test_metric_fields_and_the_docs_table_follow_the_one_definition():
    fields = [f.name for f in dataclasses.fields(mismatch.MismatchMetrics)]
    assert fields[: len(METRIC_NAMES)] == list(METRIC_NAMES)
    doc = (Path(__file__).resolve().parents[3] / "docs" / "drift.md").read_text()
    assert markdown_table() in doc, "docs/drift.md's metric table is not markdown_table()'s output"
