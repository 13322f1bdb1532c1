"""logp parity: Triton (through kernels.logp with the kernels on, strict) vs the fp32 reference.

CPU: the Triton interpreter on SMALL_T x SMALL_V; GPU: the full shapes (``gpu`` marker). Values
and gradients are compared with the reference evaluated on the same upcast logits, under the
tolerance table (kernels/tolerances.py); the max errors are recorded as metrics.
"""

from __future__ import annotations

import pytest
import torch
from rlk_op_cases import (
    DEVICE,
    DTYPES,
    FULL_T,
    FULL_V,
    SMALL_T,
    SMALL_V,
    TEMPERATURES,
    assert_close_and_record,
    make_ids,
    make_logits,
)

import kernels
from kernels import tolerances
from kernels.reference import selected_logprob


def _parity(rlk_metrics, num_tokens: int, vocab: int, dtype_name: str, temperature: float) -> None:
    dtype = DTYPES[dtype_name]
    logits = make_logits(num_tokens, vocab, dtype, seed=num_tokens + vocab).requires_grad_()
    ids = make_ids(num_tokens, vocab, seed=vocab, ignore_every=5)
    grad_out = torch.randn(num_tokens, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    out = kernels.logp(logits, ids, temperature)
    assert out.dtype == torch.float32 and out.shape == (num_tokens,)
    out.backward(grad_out)

    upcast = logits.detach().float().requires_grad_()
    expected = selected_logprob(upcast, ids, temperature)
    expected.backward(grad_out)

    assert logits.grad.dtype == dtype
    ignored = ids == kernels.IGNORE_INDEX
    assert bool((out[ignored] == 0).all()) and bool((logits.grad[ignored] == 0).all())
    tags = {"op": "logp", "dtype": dtype_name, "shape": f"{num_tokens}x{vocab}", "temperature": temperature}
    assert_close_and_record(rlk_metrics, "logp_max_abs_err", out, expected, "logp", dtype, tags, name="logp")
    assert_close_and_record(rlk_metrics, "dlogits_max_abs_err", logits.grad, upcast.grad, "logp.grad", dtype, tags,
                            name="dlogits", upstream=grad_out)
    rlk_metrics.record_fallbacks(kernels.fallback_counts())


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("vocab", SMALL_V)
@pytest.mark.parametrize("num_tokens", SMALL_T)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_logp_parity_small(triton_strict, rlk_metrics, dtype_name, num_tokens, vocab, temperature):
    _parity(rlk_metrics, num_tokens, vocab, dtype_name, temperature)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("vocab", FULL_V)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_logp_parity_full(triton_strict, rlk_metrics, dtype_name, vocab, temperature):
    _parity(rlk_metrics, FULL_T, vocab, dtype_name, temperature)
    torch.cuda.empty_cache()


def test_logp_matches_log_softmax_anchor(triton_strict):
    """Absolute anchor: equal to torch's log_softmax + gather (not only to our reference)."""
    logits = make_logits(7, 1031, torch.float32, seed=11)
    ids = make_ids(7, 1031, seed=11)
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, ids[:, None]).squeeze(-1)
    tolerances.assert_close(kernels.logp(logits, ids, 0.7), expected, "logp", torch.float32)


def test_logp_forward_only_has_no_graph(triton_strict):
    logits = make_logits(7, 1000, torch.bfloat16)
    out = kernels.logp(logits, make_ids(7, 1000))
    assert not out.requires_grad
    assert bool(torch.isfinite(out).all()) and bool((out <= 0).all())


def test_logp_accepts_row_strided_logits(triton_strict):
    """A view with a row stride > V (e.g. a slice of a padded buffer) reads the right elements."""
    padded = make_logits(7, 1100, torch.float32, seed=5)
    logits = padded[:, :1031].detach().requires_grad_()
    assert logits.stride(0) == 1100
    ids = make_ids(7, 1031)
    out = kernels.logp(logits, ids)
    out.sum().backward()
    upcast = logits.detach().clone().requires_grad_()
    expected = selected_logprob(upcast, ids)
    expected.sum().backward()
    tolerances.assert_close(out, expected, "logp", torch.float32)
    tolerances.assert_close(logits.grad, upcast.grad, "logp.grad", torch.float32)


def test_logp_int32_ids(triton_strict):
    logits = make_logits(7, 1000, torch.float32)
    ids = make_ids(7, 1000)
    assert torch.equal(kernels.logp(logits, ids.to(torch.int32)), kernels.logp(logits, ids))
