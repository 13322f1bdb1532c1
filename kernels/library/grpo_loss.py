"""``torch.ops.rlk.grpo_loss`` and ``torch.ops.rlk.grpo_loss_backward``: the ``grpo_loss`` op
(kernels/contracts/grpo_loss.py).

rlk::grpo_loss(logits [T, V], target_ids [T], old_logp [T], ref_logp [T]?, advantages [T],
               loss_mask [T], lengths [B]?, cu_seqlens [B + 1]?, rollout_logp [T]?, <LossConfig's
               fields>, temperature, ignore_index, group_name?, stats)
    -> (loss fp32 [], metrics fp32 [4] (pg_loss, pg_clipfrac, ppo_kl, kl_loss), residual fp32 [4, T'])
    ``residual``: per token the unweighted coefficient dL/dlogp / w, the row's max and sum of
    exp(z - max), and the reduction weight w, where the serving backend has a split (rlk-triton's
    fused paths), zeros otherwise; ``T' = T`` when ``stats`` (the caller differentiates), else 0;
    rows 4-7 of an [8, T'] buffer (the fused forward's own, no copy).
rlk::grpo_loss_backward(grad_loss fp32 [], residual [4, T], <the forward's arguments but stats>)
    -> grad_logits [T, V] in the logits dtype, contiguous.

No [T, V] tensor lives between the forward and the backward: the backward reads the logits again
(the caller's graph holds them) and writes dlogits from the residual. rlk-triton's split runs
exactly the eager call's kernels (``kernels.ops.grpo_loss``: ``grpo_loss_stats`` and
``grpo_loss_dlogits``), so forward and backward give the eager bits for every incoming gradient:

* two reads (the Triton path): the statistics kernel, then the dlogits kernel with grad_loss
  folded in, the eager call's sequence itself;
* one read (the CUDA cluster kernel, kernels/ops/cuda/grpo_loss_one_read.py): the cluster kernel
  with its statistics only (the eager forward's bits), then in the backward the write kernel, which
  reads grad_loss on the device and writes dlogits from the saved statistics with it folded in
  (one read of the logits, one write): the bits the eager call gives for that gradient, whether
  its forward predicted it or its backward rewrote the rows. Three passes over [T, V] (the logits
  read in each direction, dlogits written once) against the eager call's two once its prediction
  holds (one read, one write); the eager call holds dlogits from its forward on, the operators
  hold none. (The
  eager call's two passes need the backward to hand out, or rescale in place, a [T, V] buffer the
  forward wrote; AOTAutograd turns a backward's mutation of a saved tensor into a copy, a pass of
  its own.)

Every other case (GSPO and vocab-parallel calls on rlk-triton, other backends) runs the generic
split (kernels/library/serve.py): the forward without autograd, the backward recomputing it with
autograd (the backend's own backward bits, one more forward).

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
    check_values,
    needs_grad,
    recomputed_grads,
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


def _fused(call: GrpoLossCall) -> bool:
    """rlk-triton's fused paths serve the call (else its composed path: GSPO, vocab-parallel)."""
    return not call.config.gspo and call.tp_group is None


def _triton_forward(call: GrpoLossCall, stats: bool):
    if not _fused(call):
        return None
    from kernels.ops.grpo_loss import grpo_loss_stats

    return grpo_loss_stats(call, stats)


def _triton_backward(call: GrpoLossCall, grad_loss: torch.Tensor, residual: torch.Tensor):
    if not _fused(call):
        return None
    from kernels.ops.grpo_loss import grpo_loss_dlogits

    return grpo_loss_dlogits(call.logits, call.target_ids, residual, grad_loss, call.temperature, call.ignore_index)


# backend id -> (forward(call, stats) -> (loss, metrics [4], residual [4, T']) or None,
#                backward(call, grad_loss, residual) -> dlogits or None); None: the generic way
SPLITS = {"rlk-triton": (_triton_forward, _triton_backward)}


def _config(eps_clip, eps_clip_high, eps_clip_c, kl_loss_coef, kl_type, use_unbiased_kl, use_tis, tis_clip_low,
            tis_clip_high, reduction, gspo) -> LossConfig:
    return LossConfig(eps_clip, eps_clip_high, eps_clip_c, kl_loss_coef, kl_type, use_unbiased_kl, use_tis,
                      tis_clip_low, tis_clip_high, reduction, gspo)


@torch.library.custom_op("rlk::grpo_loss", mutates_args=())
def grpo_loss_forward(
    logits: torch.Tensor, target_ids: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
    advantages: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    rollout_logp: torch.Tensor | None, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None,
    kl_loss_coef: float, kl_type: str, use_unbiased_kl: bool, use_tis: bool, tis_clip_low: float,
    tis_clip_high: float, reduction: str, gspo: bool, temperature: float, ignore_index: int, group_name: str | None,
    stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    config = _config(eps_clip, eps_clip_high, eps_clip_c, kl_loss_coef, kl_type, use_unbiased_kl, use_tis,
                     tis_clip_low, tis_clip_high, reduction, gspo)
    call = _call(logits, target_ids, old_logp, ref_logp, advantages, loss_mask, lengths, cu_seqlens, rollout_logp,
                 config, temperature, ignore_index, group_name)
    check_values("grpo_loss", call, target_ids, *logits.shape)
    split_id, impl = serving("grpo_loss", call)
    split = SPLITS.get(split_id)
    found = None if split is None else split[0](call, stats)
    if found is not None:
        return found
    loss, metrics = impl(call)
    return loss, torch.stack([metrics[name] for name in METRIC_NAMES]), _residual(logits, stats).zero_()


@grpo_loss_forward.register_fake
def _(logits, target_ids, old_logp, ref_logp, advantages, loss_mask, lengths, cu_seqlens, rollout_logp, eps_clip,
      eps_clip_high, eps_clip_c, kl_loss_coef, kl_type, use_unbiased_kl, use_tis, tis_clip_low, tis_clip_high,
      reduction, gspo, temperature, ignore_index, group_name, stats):
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(4, dtype=torch.float32), _residual(logits, stats)


def _residual(logits: torch.Tensor, stats: bool) -> torch.Tensor:
    """The residual's layout: rows 4-7 of an fp32 [8, T'] buffer (the fused forward's per-token
    buffer, whose first four rows hold the metric terms), uninitialized."""
    return logits.new_empty((8, logits.shape[0] if stats else 0), dtype=torch.float32)[4:]


@torch.library.custom_op("rlk::grpo_loss_backward", mutates_args=())
def grpo_loss_backward(
    grad_loss: torch.Tensor, residual: torch.Tensor, logits: torch.Tensor, target_ids: torch.Tensor,
    old_logp: torch.Tensor, ref_logp: torch.Tensor | None, advantages: torch.Tensor, loss_mask: torch.Tensor,
    lengths: torch.Tensor | None, cu_seqlens: torch.Tensor | None, rollout_logp: torch.Tensor | None,
    eps_clip: float, eps_clip_high: float, eps_clip_c: float | None, kl_loss_coef: float, kl_type: str,
    use_unbiased_kl: bool, use_tis: bool, tis_clip_low: float, tis_clip_high: float, reduction: str, gspo: bool,
    temperature: float, ignore_index: int, group_name: str | None,
) -> torch.Tensor:
    config = _config(eps_clip, eps_clip_high, eps_clip_c, kl_loss_coef, kl_type, use_unbiased_kl, use_tis,
                     tis_clip_low, tis_clip_high, reduction, gspo)
    rest = (target_ids, old_logp, ref_logp, advantages, loss_mask, lengths, cu_seqlens, rollout_logp, config,
            temperature, ignore_index, group_name)
    call = _call(logits, *rest)
    split_id, impl = serving("grpo_loss", call)
    split = SPLITS.get(split_id)
    if split is not None and residual.shape[1] == logits.shape[0]:
        found = split[1](call, grad_loss, residual)
        if found is not None:
            return found

    def forward(leaf: torch.Tensor) -> torch.Tensor:
        return impl(_call(leaf, *rest))[0]

    return recomputed_grads(forward, [logits], [True], [grad_loss])[0]


@grpo_loss_backward.register_fake
def _(grad_loss, residual, logits, *_args):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, *tensors = inputs[:9]
    ctx.save_for_backward(logits, *tensors, output[2])
    ctx.options = inputs[9:23]
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, grad_loss, _grad_metrics, _grad_residual):
    if not ctx.needs_input_grad[0]:
        return (None,) * 24
    *tensors, residual = ctx.saved_tensors
    if residual.shape[1] != tensors[0].shape[0]:
        raise RuntimeError("rlk::grpo_loss: backward through a forward called with stats=False")
    return (torch.ops.rlk.grpo_loss_backward(grad_loss, residual, *tensors, *ctx.options), *(None,) * 23)


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
