"""fp32 reference of vime's GRPO loss, from logits (or from log-probs) to loss + metrics.

    logp     = selected_logprob(logits, target_ids, temperature)            (or vocab-parallel)
    pg, clipfrac, ppo_kl = policy_loss(logp, old_logp, advantages, eps...)   (GSPO: sequence ratio)
    pg      *= tis_weights(old_logp, rollout_logp)                           (use_tis)
    kl       = compute_kl(logp, ref_logp, kl_type, use_unbiased_kl)
    pg_loss  = reduce(pg); pg_clipfrac = reduce(clipfrac); ppo_kl = reduce(ppo_kl); kl_loss = reduce(kl)
    loss     = pg_loss + kl_loss_coef * kl_loss

``reduce`` is ``sum_of_sample_mean`` over the packed samples (``lengths``/``cu_seqlens``; neither
means one sample) or ``per_token_sum``, both weighting tokens by ``loss_mask``. Metrics are
detached 0-dim fp32 tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels import validation
from kernels.reference.kl import compute_kl
from kernels.reference.logprob import selected_logprob, vocab_parallel_selected_logprob
from kernels.reference.loss_config import LossConfig
from kernels.reference.policy_loss import gspo_sequence_log_ratio, policy_loss, tis_weights
from kernels.reference.reductions import reduce, resolve_lengths, sample_index

METRIC_NAMES = ("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss")


def check_loss_inputs(
    num_tokens: int,
    device: torch.device,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    config: LossConfig,
) -> None:
    """Shape/device/dtype checks of the per-token loss inputs (all [T])."""
    validation.check_token_vector(old_logp, "old_logp", num_tokens, device)
    validation.check_token_vector(advantages, "advantages", num_tokens, device)
    validation.check_mask(loss_mask, "loss_mask", num_tokens, device)
    if ref_logp is None:
        if config.kl_loss_coef != 0.0:
            raise ValueError("ref_logp is required when kl_loss_coef != 0")
    else:
        validation.check_token_vector(ref_logp, "ref_logp", num_tokens, device)
    if config.use_tis:
        if rollout_logp is None:
            raise ValueError("rollout_logp is required when LossConfig.use_tis is True")
        validation.check_token_vector(rollout_logp, "rollout_logp", num_tokens, device)


def grpo_loss_from_logp(
    logp: torch.Tensor,
    *,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    config: LossConfig = LossConfig(),
    rollout_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's loss from per-token log-probs ``logp`` [T] fp32 (differentiable).

    Returns ``(loss 0-dim fp32, {pg_loss, pg_clipfrac, ppo_kl, kl_loss: detached 0-dim fp32})``.
    With ``ref_logp=None`` (only allowed when ``kl_loss_coef == 0``) ``kl_loss`` is 0."""
    num_tokens = logp.shape[0]
    check_loss_inputs(num_tokens, logp.device, old_logp, ref_logp, advantages, loss_mask, rollout_logp, config)
    lens = resolve_lengths(num_tokens, logp.device, lengths, cu_seqlens)
    log_ratio = None
    if config.gspo:
        log_ratio = gspo_sequence_log_ratio(logp, old_logp, loss_mask, sample_index(lens), lens.shape[0])
    pg, clipfrac, ppo_kl = policy_loss(
        logp, old_logp, advantages, config.eps_clip, config.eps_clip_high, config.eps_clip_c, log_ratio=log_ratio
    )
    if config.use_tis:
        pg = pg * tis_weights(old_logp, rollout_logp, config.tis_clip_low, config.tis_clip_high)
    if ref_logp is None:
        kl = torch.zeros_like(pg)
    else:
        kl = compute_kl(logp, ref_logp, config.kl_type, old_logp=old_logp, use_unbiased_kl=config.use_unbiased_kl)
    pg_loss = reduce(pg, loss_mask, lens, config.reduction)
    kl_loss = reduce(kl, loss_mask, lens, config.reduction)
    loss = pg_loss + config.kl_loss_coef * kl_loss if config.kl_loss_coef != 0.0 else pg_loss
    metrics = {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": reduce(clipfrac, loss_mask, lens, config.reduction).detach(),
        "ppo_kl": reduce(ppo_kl, loss_mask, lens, config.reduction).detach(),
        "kl_loss": kl_loss.detach(),
    }
    return loss, metrics


def grpo_loss(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    config: LossConfig = LossConfig(),
    temperature: float = 1.0,
    rollout_logp: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    inplace_backward: bool = False,
    ignore_index: int = validation.IGNORE_INDEX,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's GRPO loss from logits [T, V] (or [T, V_local] with ``tp_group``).

    ``inplace_backward`` is accepted for signature parity with the kernels and ignored here (the
    reference never writes into its inputs)."""
    del inplace_backward
    if tp_group is None:
        logp = selected_logprob(logits, target_ids, temperature, ignore_index=ignore_index)
    else:
        logp = vocab_parallel_selected_logprob(logits, target_ids, temperature, tp_group, ignore_index=ignore_index)
    return grpo_loss_from_logp(
        logp,
        old_logp=old_logp,
        ref_logp=ref_logp,
        advantages=advantages,
        loss_mask=loss_mask,
        lengths=lengths,
        cu_seqlens=cu_seqlens,
        config=config,
        rollout_logp=rollout_logp,
    )
