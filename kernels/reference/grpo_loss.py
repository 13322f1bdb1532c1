"""fp32 reference of vime's GRPO loss (kernels/contracts/grpo_loss.py), from logits or from log-probs.

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

from kernels.contracts import METRIC_NAMES, GrpoLossCall, LossInputs, entry_point
from kernels.reference.kl import compute_kl
from kernels.reference.logprob import logp_call
from kernels.reference.policy_loss import gspo_sequence_log_ratio, policy_loss, tis_weights
from kernels.reference.reductions import reduce, sample_index


def grpo_loss_from_logp(logp: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's loss from per-token log-probs ``logp`` [T] fp32 (differentiable) and the other
    per-token inputs (checked here against ``logp``).

    Returns ``(loss 0-dim fp32, {pg_loss, pg_clipfrac, ppo_kl, kl_loss: detached 0-dim fp32})``.
    With ``ref_logp=None`` (only allowed when ``kl_loss_coef == 0``) ``kl_loss`` is 0."""
    num_tokens = logp.shape[0]
    if inputs.check(num_tokens, logp.device):  # the reference checks values on the host
        inputs.check_lengths_values(num_tokens)
    return reduce_grpo_loss(logp, inputs, inputs.sample_lengths(num_tokens, logp.device))


def reduce_grpo_loss(logp: torch.Tensor, inputs: LossInputs, lengths: torch.Tensor, *,
                     kl: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's loss from checked inputs: ``lengths`` the samples' [B] int64 lengths; ``kl`` [T] fp32
    the per-token KL when the caller has it (vime's adapter, from ``kernels.ratio_kl``; masked or
    not, the reductions weight it by the mask), else ``compute_kl`` of the inputs (0 without
    ``ref_logp``)."""
    config, mask = inputs.config, inputs.loss_mask
    if kl is None:
        kl = (torch.zeros_like(logp, dtype=torch.float32) if inputs.ref_logp is None else
              compute_kl(logp, inputs.ref_logp, config.kl_type, old_logp=inputs.old_logp,
                         use_unbiased_kl=config.use_unbiased_kl))
    log_ratio = None
    if config.gspo:
        log_ratio = gspo_sequence_log_ratio(logp, inputs.old_logp, mask, sample_index(lengths), lengths.shape[0])
    pg, clipfrac, ppo_kl = policy_loss(
        logp, inputs.old_logp, inputs.advantages, config.eps_clip, config.eps_clip_high, config.eps_clip_c,
        log_ratio=log_ratio,
    )
    if config.use_tis:
        pg = pg * tis_weights(inputs.old_logp, inputs.rollout_logp, config.tis_clip_low, config.tis_clip_high)
    pg_loss = reduce(pg, mask, lengths, config.reduction)
    kl_loss = reduce(kl, mask, lengths, config.reduction)
    loss = pg_loss + config.kl_loss_coef * kl_loss if config.kl_loss_coef != 0.0 else pg_loss
    terms = (pg_loss, reduce(clipfrac, mask, lengths, config.reduction), reduce(ppo_kl, mask, lengths, config.reduction),
             kl_loss)
    return loss, {name: value.detach() for name, value in zip(METRIC_NAMES, terms, strict=True)}


def grpo_loss_call(call: GrpoLossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """fp32 reference of vime's GRPO loss from logits. ``inplace_backward`` is ignored: the
    reference never writes into its inputs."""
    logp = logp_call(call)  # a GrpoLossCall has every field logp_call reads
    return reduce_grpo_loss(logp, call, call.sample_lengths(call.num_tokens, call.logits.device))


grpo_loss = entry_point(GrpoLossCall, grpo_loss_call, name="grpo_loss")

__all__ = ["METRIC_NAMES", "grpo_loss", "grpo_loss_call", "grpo_loss_from_logp", "reduce_grpo_loss"]
