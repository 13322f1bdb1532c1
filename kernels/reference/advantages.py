"""fp32 reference of vime's GRPO advantages.

For each prompt group of ``group_size`` consecutive rewards: ``A = r - mean(group)``, then
(unless ``normalize_std=False``, vime's ``--disable-grpo-std-normalization``) divided by
``std(group) + 1e-6`` with torch's default unbiased std (N - 1). A group of size 1 has an
undefined unbiased std: it is rejected.
"""

from __future__ import annotations

import torch

GRPO_STD_EPS = 1e-6


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True) -> torch.Tensor:
    """rewards: [N] (N a multiple of ``group_size``) -> per-sample advantages [N] fp32."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2 and normalize_std:
        raise ValueError("group_size must be >= 2 with std normalization (unbiased std of one value)")
    if group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"rewards length {rewards.shape[0]} is not a multiple of group_size={group_size}")
    grouped = rewards.float().view(-1, group_size)
    adv = grouped - grouped.mean(dim=-1, keepdim=True)
    if normalize_std:
        adv = adv / (grouped.std(dim=-1, keepdim=True) + GRPO_STD_EPS)
    return adv.reshape(-1)


def broadcast_to_tokens(sample_values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-sample values [B] -> per-token [T] (each sample's value on each of its tokens)."""
    return torch.repeat_interleave(sample_values, lengths.to(torch.int64))
