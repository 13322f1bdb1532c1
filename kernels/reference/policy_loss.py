"""fp32 references of vime's PPO/GRPO policy-loss pieces (per token, no reduction).

* ``ppo_kl = old_logp - logp``; ``ratio = exp(-ppo_kl)``.
* ``L1 = -ratio * A``; ``L2 = -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A``;
  ``pg = max(L1, L2)``; ``clipfrac = 1[L2 > L1]`` (float).
* Dual clip (``eps_clip_c`` not None, must be > 1): where ``A < 0``,
  ``pg = min(-eps_clip_c * A, pg)``.
* TIS: ``pg *= clamp(exp(old_logp - rollout_logp), tis_clip_low, tis_clip_high)`` (vime: 0, 2).
* GSPO: the ratio is per sequence, ``exp(mean_t(logp - old_logp))`` over the sample's masked
  tokens, broadcast back to every token of the sample.
"""

from __future__ import annotations

import torch


def tis_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, clip_low: float = 0.0, clip_high: float = 2.0
) -> torch.Tensor:
    """Truncated importance weights ``clamp(exp(old - rollout), clip_low, clip_high)``; [T] fp32."""
    return torch.exp(old_logp.float() - rollout_logp.float()).clamp(min=clip_low, max=clip_high)


def gspo_sequence_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, sample_index: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """Per-token copy of the sample's mean masked ``logp - old_logp`` (GSPO's log-ratio).

    logp, old_logp, mask: [T]; sample_index: [T] int64 (sample of each token, from
    ``reductions.sample_index``). A sample with an all-zero mask gets 0. Returns [T] fp32."""
    m = mask.float()
    diff = (logp.float() - old_logp.float()) * m
    sums = torch.zeros(num_samples, dtype=torch.float32, device=logp.device).index_add(0, sample_index, diff)
    counts = torch.zeros(num_samples, dtype=torch.float32, device=logp.device).index_add(0, sample_index, m)
    return (sums / counts.clamp(min=1.0))[sample_index]


def gspo_sequence_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, sample_index: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """GSPO sequence ratio ``exp(mean_t(logp - old_logp))`` per sample, broadcast to tokens: [T]."""
    return torch.exp(gspo_sequence_log_ratio(logp, old_logp, mask, sample_index, num_samples))


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.2,
    eps_clip_c: float | None = None,
    *,
    log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vime's clipped policy loss per token.

    logp, old_logp, advantages: [T] fp32. ``log_ratio`` overrides ``logp - old_logp`` (GSPO passes
    its sequence log-ratio). Returns ``(pg [T], clipfrac [T] float, ppo_kl [T])``.
    """
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c must be > 1 for dual clip, got {eps_clip_c}")
    ppo_kl = old_logp.float() - logp.float()
    if log_ratio is None:
        log_ratio = -ppo_kl
    ratio = torch.exp(log_ratio)
    a = advantages.float()
    l1 = -ratio * a
    l2 = -ratio.clamp(min=1.0 - eps_clip, max=1.0 + eps_clip_high) * a
    pg = torch.maximum(l1, l2)
    clipfrac = (l2 > l1).float()
    if eps_clip_c is not None:
        l3 = -eps_clip_c * a
        pg = torch.where(a < 0, torch.minimum(l3, pg), pg)
    return pg, clipfrac, ppo_kl
