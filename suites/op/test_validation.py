"""Bad input: one test per error, through the public API with the kernels on (strict) and on the
reference, so a fallback can never change which inputs are accepted."""

from __future__ import annotations

import pytest
import torch
from rlk_op_cases import DEVICE, loss_inputs, make_ids, make_logits

import kernels
from kernels import LossConfig

V = 1000


@pytest.fixture(params=["triton", "reference"])
def any_backend(request, monkeypatch):
    if request.param == "triton":
        monkeypatch.setenv("VIME_RL_KERNEL", "1")
        monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    else:
        monkeypatch.delenv("VIME_RL_KERNEL", raising=False)
    monkeypatch.delenv("VIME_RL_KERNEL_OPS", raising=False)
    monkeypatch.delenv("VIME_RL_KERNEL_BACKEND", raising=False)
    return request.param


def logits_ids(num_tokens=4, dtype=torch.float32):
    return make_logits(num_tokens, V, dtype), make_ids(num_tokens, V)


LOGP_ERRORS = {
    "not_a_tensor": (lambda: ([[0.0] * V] * 4, make_ids(4, V)), TypeError, "logits must be a torch.Tensor"),
    "1d_logits": (lambda: (make_logits(4, V, torch.float32)[0], make_ids(4, V)), ValueError, r"logits must be 2-D"),
    "float64_logits": (lambda: (make_logits(4, V, torch.float32).double(), make_ids(4, V)), ValueError, "logits dtype"),
    "empty_logits": (lambda: (make_logits(4, V, torch.float32)[:0], make_ids(4, V)[:0]), ValueError, "logits is empty"),
    "non_contiguous_vocab": (
        lambda: (make_logits(V, 4, torch.float32).t(), make_ids(4, V)), ValueError, r"contiguous along the vocab"
    ),
    "ids_wrong_length": (lambda: (make_logits(4, V, torch.float32), make_ids(5, V)), ValueError, r"target_ids must have shape \[4\]"),
    "ids_float": (lambda: (make_logits(4, V, torch.float32), make_ids(4, V).float()), ValueError, "target_ids dtype"),
    "id_too_large": (
        lambda: (make_logits(4, V, torch.float32), make_ids(4, V).index_fill(0, torch.tensor([2], device=DEVICE), V)),
        ValueError, r"target_ids has 1 id\(s\) outside \[0, 1000\) \(first: 1000\)",
    ),
    "negative_id": (
        lambda: (make_logits(4, V, torch.float32), make_ids(4, V).index_fill(0, torch.tensor([1], device=DEVICE), -1)),
        ValueError, r"outside \[0, 1000\) \(first: -1\); only ignore_index=-100",
    ),
}


@pytest.mark.parametrize("case", LOGP_ERRORS)
def test_logp_bad_input(any_backend, case, monkeypatch):
    # the values at the call on every device (the kernels' own report: test_device_errors.py)
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "strict")
    make, exc, message = LOGP_ERRORS[case]
    logits, ids = make()
    with pytest.raises(exc, match=message):
        kernels.logp(logits, ids)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_logp_bad_temperature(any_backend, temperature):
    logits, ids = logits_ids()
    with pytest.raises(ValueError, match="temperature must be a finite float > 0"):
        kernels.logp(logits, ids, temperature)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device mismatch needs a CUDA device")
def test_logp_ids_on_other_device(any_backend):
    logits, ids = logits_ids()
    with pytest.raises(ValueError, match="target_ids is on cpu but logits are on cuda"):
        kernels.logp(logits, ids.cpu())


def test_nan_logits_rejected_when_checking(any_backend, monkeypatch):
    logits, ids = logits_ids()
    logits[2, 17] = float("nan")
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_FINITE", "1")
    with pytest.raises(ValueError, match=r"logits contains 1 non-finite value\(s\)"):
        kernels.logp(logits, ids)


def test_nan_logits_stay_in_their_row_by_default(any_backend, monkeypatch):
    """Default policy: not checked; the NaN poisons only its own row."""
    monkeypatch.delenv("VIME_RL_KERNEL_CHECK_FINITE", raising=False)
    logits, ids = logits_ids()
    logits[2, 17] = float("nan")
    out = kernels.logp(logits, ids)
    assert torch.isnan(out[2]) and bool(torch.isfinite(out[[0, 1, 3]]).all())


def test_ignore_index_is_allowed(any_backend):
    logits, ids = logits_ids()
    ids[1] = kernels.IGNORE_INDEX
    out = kernels.logp(logits, ids)
    assert float(out[1]) == 0.0


GRPO_ERRORS = {
    "old_logp_shape": (lambda d: d.update(old_logp=d["old_logp"][:-1]), r"old_logp must have shape \[12\]"),
    "advantages_int": (lambda d: d.update(advantages=d["advantages"].long()), "advantages must be a floating-point"),
    "mask_int": (lambda d: d.update(loss_mask=d["loss_mask"].long()), "loss_mask must be bool or floating point"),
    "lengths_sum": (lambda d: d.update(lengths=torch.tensor([5, 6], device=DEVICE)), "lengths sum to 11 but there are 12 tokens"),
    "lengths_negative": (lambda d: d.update(lengths=torch.tensor([13, -1], device=DEVICE)), "lengths has negative entries"),
    "both_packings": (
        lambda d: d.update(cu_seqlens=torch.tensor([0, 5, 12], device=DEVICE)), "pass lengths or cu_seqlens, not both"
    ),
    "cu_seqlens_end": (
        lambda d: (d.pop("lengths"), d.update(cu_seqlens=torch.tensor([0, 5, 11], device=DEVICE))),
        "cu_seqlens must start at 0 and end at T=12",
    ),
    "kl_without_ref": (
        lambda d: d.update(ref_logp=None, config=LossConfig(kl_loss_coef=0.1)), "ref_logp is required when kl_loss_coef"
    ),
    "tis_without_rollout": (
        lambda d: d.update(rollout_logp=None, config=LossConfig(use_tis=True)), "rollout_logp is required"
    ),
}


@pytest.mark.parametrize("case", GRPO_ERRORS)
def test_grpo_loss_bad_input(any_backend, case, monkeypatch):
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "strict")  # as test_logp_bad_input
    mutate, message = GRPO_ERRORS[case]
    inputs = loss_inputs(12, V, torch.float32, lengths=[5, 7])
    mutate(inputs)
    with pytest.raises(ValueError, match=message):
        kernels.grpo_loss(**inputs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kl_type": "k4"}, "kl_type must be one of"),
        ({"reduction": "mean"}, "reduction must be one of"),
        ({"eps_clip_c": 1.0}, "eps_clip_c must be > 1"),
        ({"eps_clip": -0.1}, "eps_clip/eps_clip_high must be >= 0"),
        ({"tis_clip_low": 3.0}, "tis_clip_low must be <= tis_clip_high"),
    ],
)
def test_loss_config_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)


def test_ratio_kl_bad_inputs(any_backend):
    logp = -torch.rand(8, device=DEVICE)
    mask = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="logp must be float32"):
        kernels.ratio_kl(logp.double(), logp, logp, mask)
    with pytest.raises(ValueError, match=r"ref_logp must have shape \[8\]"):
        kernels.ratio_kl(logp, logp, logp[:7], mask)
    with pytest.raises(ValueError, match="kl_type must be one of"):
        kernels.ratio_kl(logp, logp, logp, mask, kl_type="kl")
    with pytest.raises(ValueError, match="logp is empty"):
        kernels.ratio_kl(logp[:0], logp[:0], logp[:0], mask[:0])
