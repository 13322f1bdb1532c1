"""grpo_loss's Triton kernels (device code; kernels/ops/grpo_loss.py launches them and holds the
autograd, the one-read CUDA path and the host path).

Operands (T tokens, V vocab, S samples): logits [T, V] (rows of stride ``stride_row``) fp32 | bf16 |
fp16; target ids [T] int64 | int32; old / rollout / reference log-probs, advantages and the loss
mask [T] fp32; sample lengths [S] or cu_seqlens [S + 1] int32 | int64. Outputs are fp32: the
per-token terms [7, T] (the four metric terms, the unweighted coefficient, row max, sum-exp), the
reduction weights [T], the four metrics [4] and the loss [1]; dlogits [T, V] in the logits' dtype.

* ``token_pg_and_grad``: one token's clipped policy-gradient term and its derivative (the CUDA
  kernel, kernels/ops/cuda/grpo_loss_one_read.cu, does the same math).
* ``_grpo_loss_kernel``: the two-read path's forward, one program per row.
* ``_token_weights_kernel``: the reduction weights from the mask, one program per sample.
* ``_weighted_sums_kernel``: the four metrics and the loss in a fixed summation order (one program).
* ``_grpo_dlogits_kernel``: the backward's dlogits from the row statistics, grad_output folded in.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.ops.logp import row_max_sumexp, row_target, row_write_grad
from kernels.ops.ratio_kl import kl_value_and_grad
from kernels.ops.value_checks import (
    INPUT_CU_SEQLENS,
    INPUT_LENGTHS,
    INPUT_LENGTHS_SUM,
    INPUT_TARGET_IDS,
    bad_target,
    report_bad_value,
)


@triton.jit
def token_pg_and_grad(
    logp, old_logp, adv, rollout_logp, eps_low, eps_high, eps_c, tis_low, tis_high,
    DUAL_CLIP: tl.constexpr, TIS: tl.constexpr,
):
    """(pg, clipped flag, d pg / d logp) of vime's clipped policy loss for one token.

    Gradient ties follow torch: max/min split the gradient evenly between equal operands and
    clamp passes it on the closed interval."""
    ratio = tl.exp(logp - old_logp)
    l1 = -ratio * adv
    clipped_ratio = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
    l2 = -clipped_ratio * adv
    d1 = -ratio * adv
    in_range = (ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high)
    d2 = tl.where(in_range, d1, 0.0)
    pg = tl.maximum(l1, l2)
    dpg = tl.where(l1 > l2, d1, tl.where(l2 > l1, d2, 0.5 * (d1 + d2)))
    clipped = tl.where(l2 > l1, 1.0, 0.0)
    if DUAL_CLIP:
        l3 = -eps_c * adv
        dual = tl.minimum(l3, pg)
        d_dual = tl.where(pg < l3, dpg, tl.where(pg > l3, 0.0, 0.5 * dpg))
        negative = adv < 0.0
        pg = tl.where(negative, dual, pg)
        dpg = tl.where(negative, d_dual, dpg)
    if TIS:
        w_tis = tl.minimum(tl.maximum(tl.exp(old_logp - rollout_logp), tis_low), tis_high)
        pg = pg * w_tis
        dpg = dpg * w_tis
    return pg, clipped, dpg


@triton.jit(do_not_specialize=["call_id"])
def _grpo_loss_kernel(
    logits_ptr, ids_ptr, old_ptr, ref_ptr, adv_ptr, rollout_ptr, per_token_ptr, err_ptr,
    stride_row, num_tokens, vocab, ignore_index, temperature,
    eps_low, eps_high, eps_c, tis_low, tis_high, kl_coef, call_id,
    BLOCK_V: tl.constexpr, SCALE: tl.constexpr, HAS_REF: tl.constexpr,
    KL_TYPE: tl.constexpr, UNBIASED: tl.constexpr, DUAL_CLIP: tl.constexpr, TIS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target_id = tl.load(ids_ptr + row).to(tl.int64)
    ignored = target_id == ignore_index
    m, s = row_max_sumexp(row_ptr, vocab, temperature, BLOCK_V, SCALE)
    _, z_t = row_target(row_ptr, target_id, 0, vocab, temperature, SCALE)
    logp = tl.where(ignored, 0.0, (z_t - m) - tl.log(s))
    # an id outside the vocab: NaN log-prob (so NaN loss and dlogits) and a report in the error word
    bad = bad_target(target_id, ignore_index, vocab)
    if bad:
        report_bad_value(err_ptr, call_id, INPUT_TARGET_IDS, row, target_id, vocab)
    logp = tl.where(bad, float("nan"), logp)

    old = tl.load(old_ptr + row).to(tl.float32)
    adv = tl.load(adv_ptr + row).to(tl.float32)
    rollout = old
    if TIS:
        rollout = tl.load(rollout_ptr + row).to(tl.float32)
    pg, clipped, dpg = token_pg_and_grad(
        logp, old, adv, rollout, eps_low, eps_high, eps_c, tis_low, tis_high, DUAL_CLIP, TIS
    )
    kl = 0.0
    dkl = 0.0
    if HAS_REF:
        ref = tl.load(ref_ptr + row).to(tl.float32)
        kl, dkl = kl_value_and_grad(logp, ref, old, KL_TYPE, UNBIASED)
    # d(pg + kl_coef kl)/dlogp; times the token's reduction weight it is c = dL/dlogp
    coef = tl.where(ignored, 0.0, dpg + kl_coef * dkl)
    # a bad row's terms are NaN (the clamps above would drop a NaN log-prob)
    pg = tl.where(bad, float("nan"), pg)
    kl = tl.where(bad, float("nan"), kl)
    coef = tl.where(bad, float("nan"), coef)
    # rows of a [7, T] buffer: pg, clip flag, ppo_kl, kl (weighted sums give the metrics), then what
    # the backward needs to write dlogits: the unweighted coefficient, row max, sum-exp
    tl.store(per_token_ptr + row, pg)
    tl.store(per_token_ptr + num_tokens + row, clipped)
    tl.store(per_token_ptr + 2 * num_tokens + row, old - logp)
    tl.store(per_token_ptr + 3 * num_tokens + row, kl)
    tl.store(per_token_ptr + 4 * num_tokens + row, coef)
    tl.store(per_token_ptr + 5 * num_tokens + row, m)
    tl.store(per_token_ptr + 6 * num_tokens + row, s)


@triton.jit(do_not_specialize=["call_id"])
def _token_weights_kernel(mask_ptr, offsets_ptr, weights_ptr, err_ptr, num_tokens, num_samples, call_id,
                          OFFSETS: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK: tl.constexpr):
    """The reduction weights of sample ``b`` = this program's tokens, and the packing's check.

    ``sum_of_sample_mean``: w_t = m_t / max(sum m, 1) over the sample's tokens; ``PER_TOKEN``
    (per-token sum): w_t = m_t. ``OFFSETS``: 0 one sample of all T tokens (one program), 1
    ``offsets`` are the [B] lengths (a sample starts after the lengths before it), 2 they are the
    [B + 1] cu_seqlens. Lengths that are negative or do not add up to T (cu_seqlens that fall, or
    do not run from 0 to T) are reported in the error word under ``call_id`` and make the
    sample's weights NaN; reads stay within [0, T)."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    bad = b < 0  # a scalar False
    if OFFSETS == 0:
        start = b.to(tl.int64) * 0
        end = start + num_tokens
    elif OFFSETS == 1:
        start = b.to(tl.int64) * 0
        for i in range(0, b, BLOCK):
            before = i + offs
            start += tl.sum(tl.load(offsets_ptr + before, mask=before < b, other=0).to(tl.int64), 0)
        length = tl.load(offsets_ptr + b).to(tl.int64)
        end = start + length
        if length < 0:
            report_bad_value(err_ptr, call_id, INPUT_LENGTHS, b, length, num_tokens)
            bad = b >= 0
        elif (b == num_samples - 1) & (end != num_tokens):
            report_bad_value(err_ptr, call_id, INPUT_LENGTHS_SUM, b, end, num_tokens)
            bad = b >= 0
    else:
        start = tl.load(offsets_ptr + b).to(tl.int64)
        end = tl.load(offsets_ptr + b + 1).to(tl.int64)
        if end < start:
            report_bad_value(err_ptr, call_id, INPUT_CU_SEQLENS, b + 1, end, num_tokens)
            bad = b >= 0
        elif (b == 0) & (start != 0):
            report_bad_value(err_ptr, call_id, INPUT_CU_SEQLENS, b, start, num_tokens)
            bad = b >= 0
        elif (b == num_samples - 1) & (end != num_tokens):
            report_bad_value(err_ptr, call_id, INPUT_CU_SEQLENS, b + 1, end, num_tokens)
            bad = b >= 0
    start = tl.minimum(tl.maximum(start, 0), num_tokens)
    end = tl.minimum(tl.maximum(end, start), num_tokens)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    if not PER_TOKEN:
        for t in range(start, end, BLOCK):
            cols = t + offs
            total += tl.load(mask_ptr + cols, mask=cols < end, other=0).to(tl.float32)
    scale = tl.where(bad, float("nan"), 1.0 if PER_TOKEN else tl.maximum(tl.sum(total, 0), 1.0))
    for t in range(start, end, BLOCK):
        cols = t + offs
        m = tl.load(mask_ptr + cols, mask=cols < end, other=0).to(tl.float32)
        tl.store(weights_ptr + cols, tl.math.div_rn(m, scale), mask=cols < end)


@triton.jit
def _weighted_sums_kernel(per_token_ptr, weights_ptr, metrics_ptr, loss_ptr, num_tokens, kl_coef,
                          HAS_KL: tl.constexpr, BLOCK: tl.constexpr):
    """One program: metrics[k] = sum_t w_t per_token[k, t] for the four metric rows, and the loss
    pg_loss + kl_coef * kl_loss; a fixed order, so the same inputs give the same bits."""
    offs = tl.arange(0, BLOCK)
    pg = tl.zeros([BLOCK], dtype=tl.float32)
    clip = tl.zeros([BLOCK], dtype=tl.float32)
    ppo_kl = tl.zeros([BLOCK], dtype=tl.float32)
    kl = tl.zeros([BLOCK], dtype=tl.float32)
    for t in range(0, num_tokens, BLOCK):
        cols = t + offs
        valid = cols < num_tokens
        w = tl.load(weights_ptr + cols, mask=valid, other=0.0)
        pg += tl.load(per_token_ptr + cols, mask=valid, other=0.0) * w
        clip += tl.load(per_token_ptr + num_tokens + cols, mask=valid, other=0.0) * w
        ppo_kl += tl.load(per_token_ptr + 2 * num_tokens + cols, mask=valid, other=0.0) * w
        kl += tl.load(per_token_ptr + 3 * num_tokens + cols, mask=valid, other=0.0) * w
    pg_loss = tl.sum(pg, 0)
    kl_loss = tl.sum(kl, 0)
    tl.store(metrics_ptr, pg_loss)
    tl.store(metrics_ptr + 1, tl.sum(clip, 0))
    tl.store(metrics_ptr + 2, tl.sum(ppo_kl, 0))
    tl.store(metrics_ptr + 3, kl_loss)
    if HAS_KL:
        tl.store(loss_ptr, pg_loss + kl_coef * kl_loss)
    else:
        tl.store(loss_ptr, pg_loss)


@triton.jit
def _grpo_dlogits_kernel(
    logits_ptr, grad_ptr, ids_ptr, weights_ptr, coef_ptr, grad_output_ptr, max_ptr, sumexp_ptr,
    stride_row, stride_grad_row, vocab, ignore_index, temperature,
    BLOCK_V: tl.constexpr, SCALE: tl.constexpr,
):
    """The two-read path's dlogits: one program per row, from the forward's statistics, grad_output
    read on the device (no host sync)."""
    row = tl.program_id(0).to(tl.int64)
    target_id = tl.load(ids_ptr + row).to(tl.int64)
    # c = w * coef (the product the loss's autograd forms), then grad_output folds into it before
    # the single rounding of each dlogit (exact for any scale)
    row_grad = (tl.load(weights_ptr + row) * tl.load(coef_ptr + row)) * tl.load(grad_output_ptr).to(tl.float32)
    row_write_grad(
        logits_ptr + row * stride_row, grad_ptr + row * stride_grad_row,
        tl.where(target_id == ignore_index, 0.0, row_grad), tl.load(max_ptr + row), tl.load(sumexp_ptr + row),
        target_id, vocab, temperature, BLOCK_V, SCALE,
    )
