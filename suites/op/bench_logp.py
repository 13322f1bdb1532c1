"""logp benchmarks (GPU): forward and forward+backward against the HBM limit, with peers.

Limits: forward reads the logits once (T*V*bytes); forward+backward reads them twice and writes
dlogits once (3*T*V*bytes). Peers in the same run: torch.compile of the reference math and, where
importable, Liger's ``fused_selective_log_softmax`` (forward only; its logits are [B, L+1, V]).
Small shapes are launch-bound and reported separately with the host overhead per call, tagged with
the path that served it (kernels/ops/logp.py's ``host_path``), and beside it, labelled and never gated,
the Python path's in the same process (the C++ host path off). The compiled public call
(``compiled_ops``) is a labelled variant in tests of its own, marked ``bench_full`` (a job apart
from the nightly gate).
"""

from __future__ import annotations

import pytest
import torch
from rlk_bench import (
    OURS,
    dtype_bytes,
    host_overhead_blocks_us,
    liger_available,
    measure,
    record_host_overhead,
    record_limit,
)
from rlk_compiled import measure_compiled

import kernels
from kernels import logp
from kernels.ops import logp as logp_op
from kernels.reference import selected_logprob

# the public API as a user calls it: VIME_RL_KERNEL=1, every other setting at its default
pytestmark = [pytest.mark.bench, pytest.mark.gpu, pytest.mark.usefixtures("user_default")]

SHAPES = [(8192, 151936), (4096, 32000)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LIGER_SEQ = 256  # liger wants [B, L+1, V]: T = B * L


def _inputs(num_tokens, vocab, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(num_tokens, vocab, device="cuda", dtype=dtype, generator=gen)
    ids = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=gen)
    return logits, ids


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-V{s[1]}")
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_bench_logp_forward(rlk_metrics, dtype_name, shape):
    dtype = DTYPES[dtype_name]
    num_tokens, vocab = shape
    logits, ids = _inputs(num_tokens, vocab, dtype)
    tags = {"op": "logp", "pass": "fwd", "dtype": dtype_name, "shape": f"{num_tokens}x{vocab}"}
    bytes_moved = num_tokens * vocab * dtype_bytes(dtype) + num_tokens * (8 + 4)
    record_limit(rlk_metrics, bytes_moved, tags)
    with torch.no_grad():
        ours = measure(rlk_metrics, OURS, lambda: logp(logits, ids), bytes_moved, tags, graph=True,
                       host=logp_op._HOST)
        compiled = torch.compile(selected_logprob)
        measure(rlk_metrics, "torch_compile", lambda: compiled(logits, ids), bytes_moved, tags)
        if liger_available() and num_tokens % LIGER_SEQ == 0:
            from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

            batch = num_tokens // LIGER_SEQ
            liger_logits = torch.randn(batch, LIGER_SEQ + 1, vocab, device="cuda", dtype=dtype)
            liger_ids = torch.randint(0, vocab, (batch, LIGER_SEQ + 1), device="cuda")
            liger_ms = measure(rlk_metrics, "liger",
                               lambda: fused_selective_log_softmax(liger_logits, liger_ids, 1.0), bytes_moved, tags)
            rlk_metrics.record("speedup_vs_liger", liger_ms / ours, direction="higher_is_better", space="ratio",
                               tags=tags, gate=False)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-V{s[1]}")
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_bench_logp_forward_backward(rlk_metrics, dtype_name, shape):
    dtype = DTYPES[dtype_name]
    num_tokens, vocab = shape
    logits, ids = _inputs(num_tokens, vocab, dtype)
    logits.requires_grad_()
    grad = torch.ones(num_tokens, device="cuda")
    tags = {"op": "logp", "pass": "fwd+bwd", "dtype": dtype_name, "shape": f"{num_tokens}x{vocab}"}
    bytes_moved = 3 * num_tokens * vocab * dtype_bytes(dtype)
    record_limit(rlk_metrics, bytes_moved, tags)

    def ours():
        return torch.autograd.grad(logp(logits, ids), logits, grad)

    compiled = torch.compile(selected_logprob)

    def peer():
        return torch.autograd.grad(compiled(logits, ids), logits, grad)

    measure(rlk_metrics, OURS, ours, bytes_moved, tags, graph=True, host=logp_op._HOST)
    measure(rlk_metrics, "torch_compile", peer, bytes_moved, tags)


@pytest.mark.bench_full
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-V{s[1]}")
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("pass_name", ["fwd", "fwd+bwd"])
def test_bench_logp_compiled(rlk_metrics, pass_name, dtype_name, shape):
    """The compiled public call (``compiled_ops``, a labelled variant, never gated) of each case."""
    dtype = DTYPES[dtype_name]
    num_tokens, vocab = shape
    logits, ids = _inputs(num_tokens, vocab, dtype)
    tags = {"op": "logp", "pass": pass_name, "dtype": dtype_name, "shape": f"{num_tokens}x{vocab}"}
    if pass_name == "fwd":
        bytes_moved = num_tokens * vocab * dtype_bytes(dtype) + num_tokens * (8 + 4)
        with torch.no_grad():
            measure_compiled(rlk_metrics, kernels.logp, lambda f: f(logits, ids), bytes_moved, tags)
        return
    logits.requires_grad_()
    grad = torch.ones(num_tokens, device="cuda")
    measure_compiled(rlk_metrics, kernels.logp, lambda f: torch.autograd.grad(f(logits, ids), logits, grad),
                     3 * num_tokens * vocab * dtype_bytes(dtype), tags)


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_bench_logp_small_launch_bound(rlk_metrics, num_tokens):
    """Launch-bound shapes: the host overhead per call (target < 20 us, the ids checked on the device)
    and the wall time, gated as everywhere (0.8-1.0x the graph replay here: the host's time per call
    stays below the GPU's), with the C++ host path serving the call."""
    logits, ids = _inputs(num_tokens, 151936, torch.bfloat16)
    tags = {"op": "logp", "pass": "fwd", "dtype": "bf16", "shape": f"{num_tokens}x151936", "size": "small"}
    bytes_moved = num_tokens * 151936 * 2
    with torch.no_grad():
        measure(rlk_metrics, OURS, lambda: logp(logits, ids), bytes_moved, tags, memory=False, graph=True,
                host=logp_op._HOST)
        record_host_overhead(rlk_metrics, lambda: logp(logits, ids), {**tags, "host_path": logp_op.host_path()})
        _record_python_path_host_us(rlk_metrics, lambda: logp(logits, ids), tags)


@pytest.mark.bench_full
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_bench_logp_small_launch_bound_compiled(rlk_metrics, num_tokens):
    """The compiled public call at the launch-bound shapes (a labelled variant, never gated)."""
    logits, ids = _inputs(num_tokens, 151936, torch.bfloat16)
    tags = {"op": "logp", "pass": "fwd", "dtype": "bf16", "shape": f"{num_tokens}x151936", "size": "small"}
    with torch.no_grad():
        measure_compiled(rlk_metrics, kernels.logp, lambda f: f(logits, ids), num_tokens * 151936 * 2, tags,
                         memory=False)


@pytest.mark.parametrize("num_tokens", [64])
def test_bench_logp_small_launch_bound_forward_backward(rlk_metrics, num_tokens):
    """Launch-bound fwd+bwd: host time per call (tagged with the path that served it) and the wall
    time of the plain call, which is host time here (gated in the host-time band, as the lowest of
    several rounds: ``measure``'s ``host_bound``); beside them, never gated, the Python path's host time and the
    floor in the same process, a trivial ``torch.autograd.grad((x * 2).sum(), x)``."""
    logits, ids = _inputs(num_tokens, 151936, torch.bfloat16)
    logits.requires_grad_()
    grad = torch.ones(num_tokens, device="cuda")
    tags = {"op": "logp", "pass": "fwd+bwd", "dtype": "bf16", "shape": f"{num_tokens}x151936", "size": "small"}

    def ours():
        return torch.autograd.grad(logp(logits, ids), logits, grad)

    measure(rlk_metrics, OURS, ours, 3 * num_tokens * 151936 * 2, tags, memory=False, graph=True, host=logp_op._HOST,
            host_bound=True)
    record_host_overhead(rlk_metrics, ours, {**tags, "host_path": logp_op.host_path()})
    _record_python_path_host_us(rlk_metrics, ours, tags)
    x = torch.zeros(num_tokens, device="cuda", requires_grad=True)
    floor = host_overhead_blocks_us(lambda: torch.autograd.grad((x * 2).sum(), x))
    rlk_metrics.record("autograd_floor_host_us", min(floor), unit="us", direction="lower_is_better", space="time",
                       tags={**tags, "block_medians_us": " ".join(f"{m:.1f}" for m in floor)}, gate=False)


def _record_python_path_host_us(rlk_metrics, fn, tags) -> None:
    """``python_path_host_us`` (not gated): ``fn``'s host time per call with the C++ host path off
    and nothing registered meanwhile (which would turn it back on)."""
    with logp_op._HOST.off():
        medians = host_overhead_blocks_us(fn)
    rlk_metrics.record("python_path_host_us", min(medians), unit="us", direction="lower_is_better", space="time",
                       tags={**tags, "block_medians_us": " ".join(f"{m:.1f}" for m in medians)}, gate=False)
