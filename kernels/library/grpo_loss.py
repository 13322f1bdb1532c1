"""``torch.ops.rlk.grpo_loss`` and ``torch.ops.rlk.grpo_loss_backward``: the ``grpo_loss`` op
(kernels/contracts/grpo_loss.py).

rlk::grpo_loss(logits [T, V], target_ids [T], old_logp [T], ref_logp [T]?, advantages [T],
               loss_mask [T], lengths [B]?, cu_seqlens [B + 1]?, rollout_logp [T]?, <LossConfig's
               fields>, temperature, ignore_index, unit_grad)
    -> (loss fp32 [], metrics fp32 [4] (pg_loss, pg_clipfrac, ppo_kl, kl_loss), dlogits [T', V])
rlk::grpo_loss_backward(grad_loss fp32 [], dlogits [T, V]) -> grad_logits [T, V]

The loss is a scalar, so its gradient is linear in the incoming one: with ``unit_grad`` (the
caller differentiates) the forward runs the serving backend's forward and backward at once and
returns ``dlogits`` for a gradient of 1 (the residual; ``T' = T``, else 0): every backend's
backward, the one-read kernel's (which writes dlogits while it reads the logits) included, at the
cost the eager call pays, and the same [T, V] memory. The backward scales it by the incoming
gradient: ``grad_loss * dlogits``, the same bits as the eager backward when ``grad_loss == 1``
(``loss.backward()``); for another value, one rounding of the logits dtype from it.

A call with a ``tp_group`` or ``inplace_backward=True`` runs without the operators (an operator
takes no process group, and its outputs never alias its inputs).
"""

from __future__ import annotations

import torch

from kernels import dispatch
from kernels.contracts import METRIC_NAMES, GrpoLossCall, LossConfig
from kernels.library.serve import (
    autograd_inside,
    check_values,
    needs_grad,
    serving,
    trusted,
)


def _call(logits, target_ids, old_logp, ref_logp, advantages, loss_mask, lengths, cu_seqlens, rollout_logp,
          config: LossConfig, temperature: float, ignore_index: int) -> GrpoLossCall:
    return trusted(GrpoLossCall, logits=logits, target_ids=target_ids, old_logp=old_logp, ref_logp=ref_logp,
                   advantages=advantages, loss_mask=loss_mask, lengths=lengths, cu_seqlens=cu_seqlens,
                   rollout_logp=rollout_logp, config=config, temperature=temperature, ignore_index=ignore_index,
                   num_tokens=logits.shape[0], vocab=logits.shape[1], tp_world=1, deferred=0)


@torch.library.custom_op("rlk::grpo_loss", mutates_args=())
def grpo_loss_forward(
    logits: torch.Tensor, target_ids: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
    advantages: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    rollout_logp: torch.Tensor | None, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None,
    kl_loss_coef: float, kl_type: str, use_unbiased_kl: bool, use_tis: bool, tis_clip_low: float,
    tis_clip_high: float, reduction: str, gspo: bool, temperature: float, ignore_index: int, unit_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    config = LossConfig(eps_clip, eps_clip_high, eps_clip_c, kl_loss_coef, kl_type, use_unbiased_kl, use_tis,
                        tis_clip_low, tis_clip_high, reduction, gspo)
    rest = (target_ids, old_logp, ref_logp, advantages, loss_mask, lengths, cu_seqlens, rollout_logp, config,
            temperature, ignore_index)
    call = _call(logits, *rest)
    check_values("grpo_loss", call, target_ids, *logits.shape)
    _, impl = serving("grpo_loss", call)
    if not unit_grad:
        loss, metrics = impl(call)
        return loss, torch.stack([metrics[name] for name in METRIC_NAMES]), logits.new_empty((0, logits.shape[1]))
    leaf = logits.detach().requires_grad_()
    differentiable = _call(leaf, *rest)
    differentiable.deferred = call.deferred
    with autograd_inside():
        loss, metrics = impl(differentiable)
        (dlogits,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), torch.stack([metrics[name] for name in METRIC_NAMES]), dlogits


@grpo_loss_forward.register_fake
def _(logits, target_ids, old_logp, ref_logp, advantages, loss_mask, lengths, cu_seqlens, rollout_logp, eps_clip,
      eps_clip_high, eps_clip_c, kl_loss_coef, kl_type, use_unbiased_kl, use_tis, tis_clip_low, tis_clip_high,
      reduction, gspo, temperature, ignore_index, unit_grad):
    rows = logits.shape[0] if unit_grad else 0
    return (logits.new_empty((), dtype=torch.float32), logits.new_empty(4, dtype=torch.float32),
            logits.new_empty((rows, logits.shape[1])))


@torch.library.custom_op("rlk::grpo_loss_backward", mutates_args=())
def grpo_loss_backward(grad_loss: torch.Tensor, dlogits: torch.Tensor) -> torch.Tensor:
    return (dlogits * grad_loss).to(dlogits.dtype)


@grpo_loss_backward.register_fake
def _(grad_loss, dlogits):
    return torch.empty_like(dlogits)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, grad_loss, _grad_metrics, _grad_dlogits):
    (dlogits,) = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return (None,) * 23
    if dlogits.shape[0] == 0:
        raise RuntimeError("rlk::grpo_loss: backward through a forward called with unit_grad=False")
    return (torch.ops.rlk.grpo_loss_backward(grad_loss, dlogits), *(None,) * 22)


grpo_loss_forward.register_autograd(_backward, setup_context=_setup_context)


def grpo_loss_op(call: GrpoLossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The checked ``call`` through ``torch.ops.rlk.grpo_loss`` (``tp_group`` or ``inplace_backward``:
    the dispatch directly)."""
    if call.tp_group is not None or call.inplace_backward:
        return dispatch.run("grpo_loss", call)
    c = call.config
    loss, metrics, _ = torch.ops.rlk.grpo_loss(
        call.logits, call.target_ids, call.old_logp, call.ref_logp, call.advantages, call.loss_mask, call.lengths,
        call.cu_seqlens, call.rollout_logp, c.eps_clip, c.eps_clip_high, c.eps_clip_c, c.kl_loss_coef, c.kl_type,
        c.use_unbiased_kl, c.use_tis, c.tis_clip_low, c.tis_clip_high, c.reduction, c.gspo, call.temperature,
        call.ignore_index, needs_grad(call.logits)[0])
    return loss, dict(zip(METRIC_NAMES, metrics.unbind(0), strict=True))


__all__ = ["grpo_loss_backward", "grpo_loss_forward", "grpo_loss_op"]
