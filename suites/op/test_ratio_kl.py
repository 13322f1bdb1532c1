"""ratio_kl parity: the elementwise Triton kernel vs the fp32 reference, every KL type, biased
and unbiased, with a mask; gradients to logp through both outputs."""

from __future__ import annotations

import pytest
import torch
from rlk_op_cases import DEVICE, assert_close_and_record, generator

import kernels
from kernels import tolerances
from kernels.reference import KL_TYPES
from kernels.reference import ratio_kl as reference_ratio_kl


def _inputs(num_tokens: int, seed: int = 0):
    gen = generator(seed)
    logp = -torch.rand(num_tokens, generator=gen) * 6.0  # realistic log-probs in (-6, 0]
    old = logp + 0.3 * torch.randn(num_tokens, generator=gen)
    ref = logp + 0.5 * torch.randn(num_tokens, generator=gen)
    mask = torch.rand(num_tokens, generator=gen) > 0.2
    g_ratio = torch.randn(num_tokens, generator=gen)
    g_kl = torch.randn(num_tokens, generator=gen)
    return [t.to(DEVICE) for t in (logp, old, ref, mask, g_ratio, g_kl)]


def _run(fn, logp, old, ref, mask, g_ratio, g_kl, **kw):
    leaf = logp.detach().clone().requires_grad_()
    ratio, kl = fn(leaf, old, ref, mask, **kw)
    torch.autograd.backward([ratio, kl], [g_ratio, g_kl])
    return ratio, kl, leaf.grad


@pytest.mark.parametrize("num_tokens", [1, 1000, 4099])
@pytest.mark.parametrize("use_unbiased_kl", [False, True])
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_ratio_kl_parity(triton_strict, rlk_metrics, kl_type, use_unbiased_kl, num_tokens):
    inputs = _inputs(num_tokens, seed=num_tokens)
    kw = {"kl_type": kl_type, "use_unbiased_kl": use_unbiased_kl}
    ratio, kl, grad = _run(kernels.ratio_kl, *inputs, **kw)
    e_ratio, e_kl, e_grad = _run(reference_ratio_kl, *inputs, **kw)
    tags = {"op": "ratio_kl", "kl_type": kl_type, "unbiased": use_unbiased_kl, "shape": num_tokens}
    tolerances.assert_close(ratio, e_ratio, "ratio_kl", torch.float32, name="ratio")
    assert_close_and_record(rlk_metrics, "kl_max_abs_err", kl, e_kl, "ratio_kl", torch.float32, tags, name="kl")
    assert_close_and_record(rlk_metrics, "dlogp_max_abs_err", grad, e_grad, "ratio_kl.grad", torch.float32, tags,
                            name="dlogp")
    masked = ~inputs[3]
    assert bool((ratio[masked] == 0).all()) and bool((grad[masked] == 0).all())


def test_low_var_kl_clamps_at_ten(triton_strict):
    """A log-ratio of -15 makes k3 = e^15 - 16: low_var_kl reads exactly 10 with zero gradient."""
    logp = torch.tensor([-16.0, -1.0], device=DEVICE)
    ref = torch.tensor([-1.0, -1.0], device=DEVICE)
    mask = torch.ones(2, device=DEVICE)
    _, kl, grad = _run(kernels.ratio_kl, logp, logp, ref, mask, torch.zeros(2, device=DEVICE), torch.ones(2, device=DEVICE))
    assert kl.tolist() == [10.0, 0.0]
    assert grad.tolist() == [0.0, 0.0]


def test_ratio_kl_only_one_output_used(triton_strict):
    """Backward with only the KL used (the ratio's gradient is None)."""
    logp, old, ref, mask, _, _ = _inputs(64)
    leaf = logp.clone().requires_grad_()
    _, kl = kernels.ratio_kl(leaf, old, ref, mask, kl_type="k3")
    kl.sum().backward()
    leaf2 = logp.clone().requires_grad_()
    _, kl2 = reference_ratio_kl(leaf2, old, ref, mask, kl_type="k3")
    kl2.sum().backward()
    tolerances.assert_close(leaf.grad, leaf2.grad, "ratio_kl.grad", torch.float32)
