"""fp32 references of vime's reductions over packed samples, and the packing helpers.

Packed samples ("THD"): T tokens in a row, sample b owning ``[cu_seqlens[b], cu_seqlens[b+1])``
with ``lengths[b] = cu_seqlens[b+1] - cu_seqlens[b]``.

* ``sum_of_sample_mean(x, mask, lengths) = sum_b (sum_{t in b} x_t m_t) / max(sum_{t in b} m_t, 1)``.
  A sample whose mask is all zero contributes exactly 0 (never NaN: the normalizer is clamped
  to 1, as in vime).
* ``per_token_sum(x, mask) = sum_t x_t m_t`` (vime's ``--calculate-per-token-loss``; the division
  by the token count happens later in vime's trainer, not here).
"""

from __future__ import annotations

import torch

from kernels.contracts import REDUCTIONS
from kernels.contracts.checks import check_lengths, check_lengths_values
from kernels.contracts.grpo_loss import sample_lengths


def lengths_to_cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """[B] int lengths -> [B+1] int64 cumulative offsets starting at 0."""
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=lengths.device)
    out[1:] = torch.cumsum(lengths.to(torch.int64), dim=0)
    return out


def cu_seqlens_to_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B+1] cumulative offsets -> [B] int64 lengths."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)


def resolve_lengths(
    num_tokens: int, device: torch.device, lengths: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """The [B] int64 lengths from either form; neither given means one sample of all T tokens."""
    if check_lengths(lengths, cu_seqlens, num_tokens):  # the reference checks values on the host
        check_lengths_values(lengths, cu_seqlens, num_tokens)
    return sample_lengths(num_tokens, device, lengths, cu_seqlens)


def sample_index(lengths: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """[T] int64: the sample each token belongs to. ``num_tokens`` (= lengths.sum(), validated by
    check_lengths) spares the device sync that reading the sum would cost."""
    return torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths,
                                   output_size=num_tokens)


def token_weights(mask: torch.Tensor, lengths: torch.Tensor, reduction: str) -> torch.Tensor:
    """[T] fp32 weights w with ``reduce(x) == sum_t w_t x_t``.

    ``sum_of_sample_mean``: ``w_t = m_t / max(sum_{s in sample(t)} m_s, 1)``; ``per_token_sum``:
    ``w_t = m_t``. Computed from the mask alone, so a fused kernel knows each token's share of
    the loss (and its gradient) before it reads the logits."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    m = mask.float()
    if reduction == "per_token_sum":
        return m
    idx = sample_index(lengths, m.shape[0])
    counts = torch.zeros(lengths.shape[0], dtype=torch.float32, device=m.device).index_add(0, idx, m)
    return m / counts.clamp(min=1.0)[idx]


def sum_of_sample_mean(x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum over samples of each sample's masked mean. x, mask: [T]; lengths: [B]. 0-dim fp32."""
    m = mask.float()
    idx = sample_index(lengths.to(torch.int64), x.shape[0])
    sums = torch.zeros(lengths.shape[0], dtype=torch.float32, device=x.device).index_add(0, idx, x.float() * m)
    counts = torch.zeros(lengths.shape[0], dtype=torch.float32, device=x.device).index_add(0, idx, m)
    return (sums / counts.clamp(min=1.0)).sum()


def per_token_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked token sum. x, mask: [T]. 0-dim fp32."""
    return (x.float() * mask.float()).sum()


def reduce(x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, reduction: str) -> torch.Tensor:
    """Apply the named reduction (``sum_of_sample_mean`` or ``per_token_sum``)."""
    if reduction == "sum_of_sample_mean":
        return sum_of_sample_mean(x, mask, lengths)
    if reduction == "per_token_sum":
        return per_token_sum(x, mask)
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
