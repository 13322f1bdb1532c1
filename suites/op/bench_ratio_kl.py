"""ratio_kl benchmark (GPU): elementwise forward and forward+backward against the HBM limit.

Forward moves 4 fp32 reads (logp, old, ref, mask as fp32) and 2 writes per token; the backward
reads the same 4 plus 2 incoming gradients and writes 1. Peer: torch.compile of the reference.
Small shapes (T <= 64) are launch-bound: reported separately, with the host overhead per call.
The compiled public call (``compiled_ops``) is a labelled variant in tests of its own, marked
``bench_full`` (a job apart from the nightly gate)."""

from __future__ import annotations

import pytest
import torch
from rlk_bench import OURS, measure, record_host_overhead, record_limit
from rlk_compiled import COMPILED, measure_compiled

import kernels
from kernels import ratio_kl
from kernels.ops import ratio_kl as ratio_kl_op
from kernels.reference import ratio_kl as reference_ratio_kl

# the public API as a user calls it: VIME_RL_KERNEL=1, every other setting at its default
pytestmark = [pytest.mark.bench, pytest.mark.gpu, pytest.mark.usefixtures("user_default")]

NUM_TOKENS = 1 << 24  # large enough to be bandwidth-bound
FWD_BYTES = 6 * 4 * NUM_TOKENS
FWD_BWD_BYTES = FWD_BYTES + 7 * 4 * NUM_TOKENS


def _inputs(num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logp = -torch.rand(num_tokens, device="cuda", generator=gen) * 5
    old = logp + 0.1 * torch.randn(num_tokens, device="cuda", generator=gen)
    ref = logp + 0.1 * torch.randn(num_tokens, device="cuda", generator=gen)
    mask = (torch.rand(num_tokens, device="cuda", generator=gen) > 0.1).float()
    return logp, old, ref, mask


@pytest.mark.parametrize("kl_type", ["low_var_kl", "k2"])
def test_bench_ratio_kl(rlk_metrics, kl_type):
    logp, old, ref, mask = _inputs(NUM_TOKENS)
    tags = {"op": "ratio_kl", "kl_type": kl_type, "shape": str(NUM_TOKENS), "dtype": "fp32"}
    fwd_bytes = FWD_BYTES
    record_limit(rlk_metrics, fwd_bytes, {**tags, "pass": "fwd"})
    with torch.no_grad():
        measure(rlk_metrics, OURS, lambda: ratio_kl(logp, old, ref, mask, kl_type=kl_type), fwd_bytes,
                {**tags, "pass": "fwd"}, graph=True, host=ratio_kl_op._HOST)
        compiled = torch.compile(reference_ratio_kl)
        measure(rlk_metrics, "torch_compile", lambda: compiled(logp, old, ref, mask, kl_type=kl_type), fwd_bytes,
                {**tags, "pass": "fwd"})
    leaf = logp.clone().requires_grad_()
    g = torch.ones(NUM_TOKENS, device="cuda")

    def fwd_bwd():
        ratio, kl = ratio_kl(leaf, old, ref, mask, kl_type=kl_type)
        return torch.autograd.grad([ratio, kl], leaf, [g, g])

    fwd_bwd_bytes = FWD_BWD_BYTES
    record_limit(rlk_metrics, fwd_bwd_bytes, {**tags, "pass": "fwd+bwd"}, name="hbm_limit_fwd_bwd_ms")
    result_ms = measure(rlk_metrics, f"{OURS}_fwd_bwd", fwd_bwd, fwd_bwd_bytes, {**tags, "pass": "fwd+bwd"},
                        graph=True, gate=True, host=ratio_kl_op._HOST)
    assert result_ms > 0


@pytest.mark.bench_full
@pytest.mark.parametrize("kl_type", ["low_var_kl", "k2"])
def test_bench_ratio_kl_compiled(rlk_metrics, kl_type):
    """The compiled public call (``compiled_ops``, a labelled variant, never gated), fwd and fwd+bwd."""
    logp, old, ref, mask = _inputs(NUM_TOKENS)
    tags = {"op": "ratio_kl", "kl_type": kl_type, "shape": str(NUM_TOKENS), "dtype": "fp32"}
    with torch.no_grad():
        measure_compiled(rlk_metrics, kernels.ratio_kl, lambda f: f(logp, old, ref, mask, kl_type=kl_type),
                         FWD_BYTES, {**tags, "pass": "fwd"})
    leaf = logp.clone().requires_grad_()
    g = torch.ones(NUM_TOKENS, device="cuda")

    def compiled_fwd_bwd(f):
        ratio, kl = f(leaf, old, ref, mask, kl_type=kl_type)
        return torch.autograd.grad([ratio, kl], leaf, [g, g])

    measure_compiled(rlk_metrics, kernels.ratio_kl, compiled_fwd_bwd, FWD_BWD_BYTES, {**tags, "pass": "fwd+bwd"},
                     impl=f"{COMPILED}_fwd_bwd")


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_bench_ratio_kl_small_launch_bound(rlk_metrics, num_tokens):
    """Launch-bound shapes: the host overhead per call (target < 20 us) and the wall time of the
    plain call, gated as everywhere (0.8-1.0x the graph replay here), with the C++ host path
    serving the call."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logp = -torch.rand(num_tokens, device="cuda", generator=gen) * 5
    old, ref = logp + 0.1, logp - 0.1
    mask = torch.rand(num_tokens, device="cuda", generator=gen) > 0.1
    tags = {"op": "ratio_kl", "pass": "fwd", "dtype": "fp32", "shape": str(num_tokens), "size": "small"}
    with torch.no_grad():
        measure(rlk_metrics, OURS, lambda: ratio_kl(logp, old, ref, mask), 6 * 4 * num_tokens, tags, memory=False,
                graph=True, host=ratio_kl_op._HOST)
        # which path the host time is of: the C++ host path, or why not (kernels/ops/host/)
        record_host_overhead(rlk_metrics, lambda: ratio_kl(logp, old, ref, mask),
                             {**tags, "host_path": ratio_kl_op.host_path()})


@pytest.mark.bench_full
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_bench_ratio_kl_small_launch_bound_compiled(rlk_metrics, num_tokens):
    """The compiled public call at the launch-bound shapes (a labelled variant, never gated)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logp = -torch.rand(num_tokens, device="cuda", generator=gen) * 5
    old, ref = logp + 0.1, logp - 0.1
    mask = torch.rand(num_tokens, device="cuda", generator=gen) > 0.1
    tags = {"op": "ratio_kl", "pass": "fwd", "dtype": "fp32", "shape": str(num_tokens), "size": "small"}
    with torch.no_grad():
        measure_compiled(rlk_metrics, kernels.ratio_kl, lambda f: f(logp, old, ref, mask), 6 * 4 * num_tokens, tags,
                         memory=False)
