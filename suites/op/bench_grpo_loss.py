"""grpo_loss benchmarks (GPU): forward+backward to dlogits against the HBM limit, with peers.

Limit: read the logits once and write dlogits once (2*T*V*bytes). vime math, per-sample
reduction, KL term on. Peers in the same run: torch.compile of the reference (vime math) and,
where importable, Liger's ``triton_grpo_loss`` (loss_type "grpo"; its math differs from vime's,
the work is the same: recorded for the roofline table, never gated). Extra memory: ours is the
dlogits tensor; with ``inplace_backward`` none. ``rlk`` is the default path (the one-read cluster
kernel where it applies), timed as a plain call with default settings (the ids and lengths checked
by the kernels, no host sync): its wall time gates, its CUDA-graph replay is recorded beside it.
``rlk_scaled_grad`` is the call a training step makes, gated beside the plain call: the loss scaled
before the backward, as vime's ``loss_function`` scales it for Megatron (``loss * num_microbatches
/ global_batch_size * dp_size``, here 8 / 256): in a training step the gradient reaching the op is
not 1. Labelled variants, never gated, in tests of their own marked ``bench_full`` (a job apart
from the nightly gate: ``-m bench_full``): ``rlk_two_read`` the Triton path, ``rlk_inplace`` the
in-place backward (a two-read path), ``rlk_strict`` the host-side checks
(``VIME_RL_KERNEL_CHECK_IDS=strict``), ``compiled_ops`` the public call under
``torch.compile(fullgraph=True)`` (suites/op/rlk_compiled.py), and the scaled calls of those and of
Liger. The one-read forward writes
dlogits for the gradient the last backward met, so the timed calls (after ``do_bench``'s warm-up,
whose first backward is a miss) are the steady state of a training loop (Liger's scales its stored
gradient).
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
from rlk_compiled import COMPILED, measure_compiled

import kernels
from kernels import LossConfig, grpo_loss
from kernels.ops import grpo_loss as grpo_loss_op
from kernels.reference import grpo_loss as reference_grpo_loss

# the public API as a user calls it: VIME_RL_KERNEL=1, every other setting at its default
pytestmark = [pytest.mark.bench, pytest.mark.gpu, pytest.mark.usefixtures("user_default")]

SHAPES = [(8192, 151936), (4096, 32000)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Cases whose plain fwd+bwd call is host-bound: GPU time (a graph replay) at or below the call's
# host time, so their wall time follows the host's speed regime (``measure``'s ``host_bound``).
# bf16 [4096, 32000]: 0.149 ms of GPU time on the H200 and 0.198 on the H100 against 0.125-0.195 ms
# of fwd+bwd host time on those hosts (docs/performance-notes.md); one unchanged H200 run read 0.220
# ms of wall against a 0.153 baseline. The kernels' speed gates on the large shape.
HOST_BOUND_CASES = {("bf16", (4096, 32000))}
SEQ = 256
CONFIG = LossConfig(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.01, kl_type="low_var_kl")
# vime's loss_function: loss * num_microbatches / step_global_batch_size * dp_world_size, then
# Megatron divides by num_microbatches: 8 data-parallel ranks, a global batch of 256 samples
GRAD_SCALE = 8 / 256


def _inputs(num_tokens, vocab, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(num_tokens, vocab, device="cuda", dtype=dtype, generator=gen)
    ids = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=gen)
    base = -torch.rand(num_tokens, device="cuda", generator=gen) * 5
    kw = {
        "old_logp": base + 0.1 * torch.randn(num_tokens, device="cuda", generator=gen),
        "ref_logp": base + 0.1 * torch.randn(num_tokens, device="cuda", generator=gen),
        "advantages": torch.randn(num_tokens, device="cuda", generator=gen),
        "loss_mask": torch.rand(num_tokens, device="cuda", generator=gen) > 0.1,
        "lengths": torch.full((max(1, num_tokens // SEQ),), min(SEQ, num_tokens), device="cuda"),
    }
    return logits, ids, kw


def _case(dtype_name, shape):
    """(logits with grad, ids, the loss's other inputs, tags, HBM bytes) of one fwd+bwd case."""
    num_tokens, vocab = shape
    logits, ids, kw = _inputs(num_tokens, vocab, DTYPES[dtype_name])
    logits.requires_grad_()
    tags = {"op": "grpo_loss", "pass": "fwd+bwd", "dtype": dtype_name, "shape": f"{num_tokens}x{vocab}"}
    return logits, ids, kw, tags, 2 * num_tokens * vocab * dtype_bytes(DTYPES[dtype_name])


def _liger_call(logits, kw, ids, grad_scale: float = 1.0):
    """Liger's ``triton_grpo_loss`` fwd+bwd on the same case ([B, SEQ + 1, V] logits of its own)."""
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    num_tokens, vocab = logits.shape
    batch = num_tokens // SEQ
    liger_logits = torch.randn(batch, SEQ + 1, vocab, device="cuda", dtype=logits.dtype).requires_grad_()
    shaped = {k: kw[k].view(batch, SEQ) for k in ("old_logp", "ref_logp")}
    liger_ids = ids.view(batch, SEQ)
    adv = kw["advantages"].view(batch, SEQ)[:, 0].contiguous()
    mask = kw["loss_mask"].view(batch, SEQ).int()

    def liger():
        out = triton_grpo_loss(liger_logits, shaped["old_logp"], shaped["ref_logp"], liger_ids, adv, mask,
                               temperature=1.0, beta=0.01, eps_low=0.2, eps_high=0.28, inplace=False,
                               loss_type="grpo", reduce=True)
        loss = out[0] if isinstance(out, tuple) else out
        return torch.autograd.grad(loss * grad_scale if grad_scale != 1.0 else loss, liger_logits)

    return liger


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-V{s[1]}")
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_bench_grpo_loss_forward_backward(rlk_metrics, dtype_name, shape):
    """The nightly gate's cases: the plain call and the training step's call (the loss scaled
    before the backward), both gated, timed the same way (host-bound cases as the lowest of
    rounds) with their graph replays beside them; peers torch.compile and Liger in the same run."""
    logits, ids, kw, tags, bytes_moved = _case(dtype_name, shape)
    record_limit(rlk_metrics, bytes_moved, tags)
    host_bound = (dtype_name, shape) in HOST_BOUND_CASES

    def ours():
        loss, _ = grpo_loss(logits, ids, config=CONFIG, **kw)
        return torch.autograd.grad(loss, logits)

    def ours_scaled_grad():
        loss, _ = grpo_loss(logits, ids, config=CONFIG, **kw)
        return torch.autograd.grad(loss * GRAD_SCALE, logits)

    ours_ms = measure(rlk_metrics, OURS, ours, bytes_moved, tags, graph=True, host=grpo_loss_op._HOST,
                      host_bound=host_bound)
    # the call vime's training step makes: gated beside the plain call (its GPU time is the plain
    # call's; at a host-bound shape the scale's multiply and its backward node add host time)
    measure(rlk_metrics, f"{OURS}_scaled_grad", ours_scaled_grad, bytes_moved,
            {**tags, "variant": f"loss x {GRAD_SCALE:g} before the backward (vime's training step)"},
            gate=True, graph=True, host=grpo_loss_op._HOST, host_bound=host_bound)

    compiled = torch.compile(reference_grpo_loss)

    def peer():
        loss, _ = compiled(logits, ids, config=CONFIG, **kw)
        return torch.autograd.grad(loss, logits)

    compiled_ms = measure(rlk_metrics, "torch_compile", peer, bytes_moved, tags)
    rlk_metrics.record("speedup_vs_torch_compile", compiled_ms / ours_ms, direction="higher_is_better",
                       space="ratio", tags=tags, gate=False)
    if liger_available():
        liger_ms = measure(rlk_metrics, "liger", _liger_call(logits, kw, ids), bytes_moved, tags)
        rlk_metrics.record("speedup_vs_liger", liger_ms / ours_ms, direction="higher_is_better", space="ratio",
                           tags=tags, gate=False)


@pytest.mark.bench_full
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-V{s[1]}")
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_bench_grpo_loss_forward_backward_variants(rlk_metrics, monkeypatch, dtype_name, shape):
    """The labelled variants of the same cases, never gated (the ``bench_full`` job): the two-read
    Triton path, the host-side checks, the in-place backward, the compiled public call (plain and
    scaled) and Liger's scaled call."""
    logits, ids, kw, tags, bytes_moved = _case(dtype_name, shape)
    record_limit(rlk_metrics, bytes_moved, tags)

    def ours():
        loss, _ = grpo_loss(logits, ids, config=CONFIG, **kw)
        return torch.autograd.grad(loss, logits)

    # the two-read Triton path (what serves GPUs without clusters or nvcc)
    monkeypatch.setenv("RLK_GRPO_ONE_READ", "0")
    measure(rlk_metrics, f"{OURS}_two_read", ours, bytes_moved, tags, memory=False)
    monkeypatch.delenv("RLK_GRPO_ONE_READ")
    # the host-side checks (two host syncs per call): what the default path no longer pays
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "strict")
    measure(rlk_metrics, f"{OURS}_strict", ours, bytes_moved, tags, memory=False)
    monkeypatch.delenv("VIME_RL_KERNEL_CHECK_IDS")

    work = logits.detach().clone().requires_grad_()

    def ours_inplace():
        # the kernel overwrites the buffer with dlogits; values stay finite, so reuse is valid timing
        x = work.detach().requires_grad_()
        loss, _ = grpo_loss(x, ids, config=CONFIG, inplace_backward=True, **kw)
        return torch.autograd.grad(loss, x)

    measure(rlk_metrics, f"{OURS}_inplace", ours_inplace, bytes_moved, tags)

    def compiled_ours(f):
        loss, _ = f(logits, ids, config=CONFIG, **kw)
        return torch.autograd.grad(loss, logits)

    def compiled_ours_scaled_grad(f):
        loss, _ = f(logits, ids, config=CONFIG, **kw)
        return torch.autograd.grad(loss * GRAD_SCALE, logits)

    measure_compiled(rlk_metrics, kernels.grpo_loss, compiled_ours, bytes_moved, tags)
    measure_compiled(rlk_metrics, kernels.grpo_loss, compiled_ours_scaled_grad, bytes_moved, tags,
                     impl=f"{COMPILED}_scaled_grad", memory=False)
    if liger_available():
        measure(rlk_metrics, "liger_scaled_grad", _liger_call(logits, kw, ids, GRAD_SCALE), bytes_moved, tags,
                memory=False)


@pytest.mark.parametrize("num_tokens", [64, 256])
def test_bench_grpo_loss_small_launch_bound(rlk_metrics, num_tokens):
    """Launch-bound shapes: host time per fwd+bwd call (goal < 60 us, every check on the device;
    tagged with the path that served it, kernels/ops/grpo_loss.py's ``host_path``) and the wall
    time of the plain call, which is host time here (gated in the host-time band, as the lowest of
    several rounds: ``measure``'s ``host_bound``). Beside it, labelled and never gated, the floor in the same
    process: ``autograd_floor_host_us``, a trivial ``torch.autograd.grad((x * 2).sum(), x)``, so
    the record says how much of the call is autograd's own machinery."""
    logits, ids, kw = _inputs(num_tokens, 151936, torch.bfloat16)
    logits.requires_grad_()
    tags = {"op": "grpo_loss", "pass": "fwd+bwd", "dtype": "bf16", "shape": f"{num_tokens}x151936", "size": "small"}

    def ours():
        loss, _ = grpo_loss(logits, ids, config=CONFIG, **kw)
        return torch.autograd.grad(loss, logits)

    measure(rlk_metrics, OURS, ours, 2 * num_tokens * 151936 * 2, tags, memory=False, graph=True,
            host=grpo_loss_op._HOST, host_bound=True)
    record_host_overhead(rlk_metrics, ours, {**tags, "host_path": grpo_loss_op.host_path()})
    x = torch.zeros(num_tokens, device="cuda", requires_grad=True)
    floor = host_overhead_blocks_us(lambda: torch.autograd.grad((x * 2).sum(), x))
    rlk_metrics.record("autograd_floor_host_us", min(floor), unit="us", direction="lower_is_better", space="time",
                       tags={**tags, "block_medians_us": " ".join(f"{m:.1f}" for m in floor)}, gate=False)


@pytest.mark.bench_full
@pytest.mark.parametrize("num_tokens", [64, 256])
def test_bench_grpo_loss_small_launch_bound_compiled(rlk_metrics, num_tokens):
    """The compiled public call at the launch-bound shapes (a labelled variant, never gated)."""
    logits, ids, kw = _inputs(num_tokens, 151936, torch.bfloat16)
    logits.requires_grad_()
    tags = {"op": "grpo_loss", "pass": "fwd+bwd", "dtype": "bf16", "shape": f"{num_tokens}x151936", "size": "small"}

    def compiled_ours(f):
        loss, _ = f(logits, ids, config=CONFIG, **kw)
        return torch.autograd.grad(loss, logits)

    measure_compiled(rlk_metrics, kernels.grpo_loss, compiled_ours, 2 * num_tokens * 151936 * 2, tags, memory=False)
