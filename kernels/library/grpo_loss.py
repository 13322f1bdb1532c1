"""``torch.ops.rlk.grpo_loss`` and ``torch.ops.rlk.grpo_loss_backward``: the ``grpo_loss`` op
(kernels/contracts/grpo_loss.py).

rlk::grpo_loss(logits [T, V], target_ids [T], old_logp [T], ref_logp [T]?, advantages [T],
               loss_mask [T], lengths [B]?, cu_seqlens [B + 1]?, rollout_logp [T]?, <LossConfig's
               fields>, temperature, ignore_index, group_name?, unit_grad)
    -> (loss fp32 [], metrics fp32 [4] (pg_loss, pg_clipfrac, ppo_kl, kl_loss), dlogits [T', V])
rlk::grpo_loss_backward(grad_loss fp32 [], dlogits [T, V]) -> grad_logits [T, V]

The loss is a scalar, so its gradient is linear in the incoming one: with ``unit_grad`` (the
caller differentiates) the forward runs the serving backend's forward and backward at once and
returns ``dlogits`` for a gradient of 1 (the residual; ``T' = T``, else 0): every backend's
backward, the one-read kernel's (which writes dlogits while it reads the logits) included, at the
cost the eager call pays, and the same [T, V] memory. rlk-triton's split (its fused paths) runs its
kernels directly (``kernels.ops.grpo_loss.grpo_loss_unit_grad``); every other case
differentiates the backend's implementation inside the operator (one more autograd engine run).
The backward scales it by the incoming gradient: ``grad_loss * dlogits``, the same bits as the
eager backward when ``grad_loss == 1`` (``loss.backward()``); for another value, one rounding of
the logits dtype from it. It costs one pass over [T, V] that the eager call skips for
``grad_loss == 1``; skipping it needs the backward to scale the forward's dlogits in place, and
an operator whose backward mutates one of its forward's outputs fails AOTAutograd's partition
(``torch.library.opcheck``) wherever that output is also returned.

``group_name``: the vocab-parallel group's registered name (``tp_group.group_name``), or None.

``inplace_backward=True`` runs without the operators, outside the compiled graph, and says so
(:func:`grpo_loss_inplace`): its backward hands back the logits' own storage, overwritten, as
their gradient. An operator can declare that it mutates an input, but here the mutation would
happen in the backward, to a tensor that requires grad and is saved by the forward, and the
gradient would alias it; AOTAutograd functionalizes such a backward (a copy where the call
exists to save one) or refuses it, so the memory saving the option exists for cannot hold in a
compiled graph.
"""

from __future__ import annotations

import functools
import logging

import torch

from kernels import dispatch
from kernels.contracts import METRIC_NAMES, GrpoLossCall, LossConfig
from kernels.library.serve import (
    autograd_inside,
    check_values,
    needs_grad,
    registered_name,
    serving,
    tp_fields,
    trusted,
)

logger = logging.getLogger("kernels")


def _call(logits, target_ids, old_logp, ref_logp, advantages, loss_mask, lengths, cu_seqlens, rollout_logp,
          config: LossConfig, temperature: float, ignore_index: int, group: str | None) -> GrpoLossCall:
    return trusted(GrpoLossCall, logits=logits, target_ids=target_ids, old_logp=old_logp, ref_logp=ref_logp,
                   advantages=advantages, loss_mask=loss_mask, lengths=lengths, cu_seqlens=cu_seqlens,
                   rollout_logp=rollout_logp, config=config, temperature=temperature, ignore_index=ignore_index,
                   num_tokens=logits.shape[0], vocab=logits.shape[1], deferred=0, **tp_fields(group))


def _triton_forward(call: GrpoLossCall, unit_grad: bool):
    """rlk-triton's fused paths without autograd, or None where the call takes its composed path."""
    if call.config.gspo or call.tp_group is not None:
        return None
    from kernels.ops.grpo_loss import grpo_loss_unit_grad

    return grpo_loss_unit_grad(call, unit_grad)


# backend id -> forward(call, unit_grad) -> (loss, metrics [4], dlogits or None), or None: the generic way
SPLITS = {"rlk-triton": _triton_forward}


@torch.library.custom_op("rlk::grpo_loss", mutates_args=())
def grpo_loss_forward(
    logits: torch.Tensor, target_ids: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
    advantages: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    rollout_logp: torch.Tensor | None, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None,
    kl_loss_coef: float, kl_type: str, use_unbiased_kl: bool, use_tis: bool, tis_clip_low: float,
    tis_clip_high: float, reduction: str, gspo: bool, temperature: float, ignore_index: int, group_name: str | None,
    unit_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    config = LossConfig(eps_clip, eps_clip_high, eps_clip_c, kl_loss_coef, kl_type, use_unbiased_kl, use_tis,
                        tis_clip_low, tis_clip_high, reduction, gspo)
    rest = (target_ids, old_logp, ref_logp, advantages, loss_mask, lengths, cu_seqlens, rollout_logp, config,
            temperature, ignore_index, group_name)
    call = _call(logits, *rest)
    check_values("grpo_loss", call, target_ids, *logits.shape)
    backend, impl = serving("grpo_loss", call)
    split = SPLITS.get(backend)
    found = None if split is None else split(call, unit_grad)
    if found is not None:
        loss, metrics, dlogits = found
        return loss, metrics, logits.new_empty((0, logits.shape[1])) if dlogits is None else dlogits
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
      reduction, gspo, temperature, ignore_index, group_name, unit_grad):
    rows = logits.shape[0] if unit_grad else 0
    return (logits.new_empty((), dtype=torch.float32), logits.new_empty(4, dtype=torch.float32),
            logits.new_empty((rows, logits.shape[1])))


@torch.library.custom_op("rlk::grpo_loss_backward", mutates_args=())
def grpo_loss_backward(grad_loss: torch.Tensor, dlogits: torch.Tensor) -> torch.Tensor:
    # with the kernels on a GPU: one vectorized pass (kernels/ops/grpo_loss.py, scale_dlogits);
    # PyTorch's own bf16 x fp32-0-dim product takes its casting path (2.8x slower on an H200)
    if dlogits.is_cuda and dispatch.kernels_enabled():
        from kernels.ops.grpo_loss import scale_dlogits

        return scale_dlogits(dlogits, grad_loss)
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
        return (None,) * 24
    if dlogits.shape[0] == 0:
        raise RuntimeError("rlk::grpo_loss: backward through a forward called with unit_grad=False")
    return (torch.ops.rlk.grpo_loss_backward(grad_loss, dlogits), *(None,) * 23)


grpo_loss_forward.register_autograd(_backward, setup_context=_setup_context)


@torch.compiler.disable(reason="grpo_loss(inplace_backward=True) runs outside the compiled graph: its backward "
                                "overwrites the logits with their gradient, which a compiled graph cannot hold "
                                "(kernels/library/grpo_loss.py)")
def grpo_loss_inplace(call: GrpoLossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """An ``inplace_backward=True`` call, eager, under ``torch.compile``: a graph break (an error
    under ``fullgraph=True``) whose reason names the option, and a warning, once per process."""
    _warn_inplace_under_compile()
    return dispatch.run("grpo_loss", call)


@functools.cache
def _warn_inplace_under_compile() -> None:
    logger.warning("kernels: grpo_loss(inplace_backward=True) under torch.compile runs eagerly, between two "
                   "compiled graphs (a graph break): a compiled graph cannot overwrite the logits with "
                   "their gradient; inplace_backward=False compiles into the graph")


def grpo_loss_op(call: GrpoLossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The checked ``call`` through ``torch.ops.rlk.grpo_loss`` (``inplace_backward``: eager, see
    :func:`grpo_loss_inplace`)."""
    if call.inplace_backward:
        return grpo_loss_inplace(call)
    c = call.config
    loss, metrics, _ = torch.ops.rlk.grpo_loss(
        call.logits, call.target_ids, call.old_logp, call.ref_logp, call.advantages, call.loss_mask, call.lengths,
        call.cu_seqlens, call.rollout_logp, c.eps_clip, c.eps_clip_high, c.eps_clip_c, c.kl_loss_coef, c.kl_type,
        c.use_unbiased_kl, c.use_tis, c.tis_clip_low, c.tis_clip_high, c.reduction, c.gspo, call.temperature,
        call.ignore_index, registered_name(call.tp_group), needs_grad(call.logits)[0])
    return loss, dict(zip(METRIC_NAMES, metrics.unbind(0), strict=True))


__all__ = ["SPLITS", "grpo_loss_backward", "grpo_loss_forward", "grpo_loss_inplace", "grpo_loss_op"]
