"""``torch.ops.rlk.logp`` and ``torch.ops.rlk.logp_backward``: the ``logp`` op (kernels/contracts/logp.py).

rlk::logp(logits [T, V], target_ids [T], temperature, ignore_index, group_name?, stats)
    -> (logp fp32 [T], residual fp32 [2, T'])
    ``residual``: the rows' (global) max and sum of exp(z - max) where the serving backend has a
    split (rlk-triton), zeros for the generic split; ``T' = T`` when ``stats`` (the caller
    differentiates), else 0.
rlk::logp_backward(grad fp32 [T], logits, target_ids, residual, temperature, ignore_index, group_name?)
    -> dlogits [T, V] in the logits dtype, contiguous.

``group_name``: the vocab-parallel group's registered name (``tp_group.group_name``), or None;
``logits`` are then this rank's [T, V_local] shard.
"""

from __future__ import annotations

import torch

from kernels.contracts import LogpCall
from kernels.library.serve import (
    check_values,
    needs_grad,
    recomputed_grads,
    registered_name,
    serving,
    tp_fields,
    trusted,
)


def _call(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float, ignore_index: int,
          group: str | None) -> LogpCall:
    return trusted(LogpCall, logits=logits, target_ids=target_ids, temperature=temperature, ignore_index=ignore_index,
                   num_tokens=logits.shape[0], vocab=logits.shape[1], deferred=0, **tp_fields(group))


def _triton_forward(call: LogpCall) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.ops.logp import logp_forward_stats

    logp, row_max, sumexp, _ = logp_forward_stats(call.logits, call.target_ids, call.temperature, call.ignore_index,
                                                  call.tp_group, call.deferred)
    return logp, torch.stack((row_max, sumexp))


def _triton_backward(call: LogpCall, grad: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    from kernels.ops.logp import launch_logp_backward

    logits = call.logits
    vocab_start = 0 if call.tp_group is None else torch.distributed.get_rank(call.tp_group) * logits.shape[1]
    grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    return launch_logp_backward(logits, grad_logits, call.target_ids, grad.contiguous(), residual[0], residual[1],
                                call.temperature, call.ignore_index, vocab_start)


# backend id -> (forward(call) -> (logp, residual), backward(call, grad, residual) -> dlogits)
SPLITS = {"rlk-triton": (_triton_forward, _triton_backward)}


@torch.library.custom_op("rlk::logp", mutates_args=())
def logp_forward(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float, ignore_index: int,
                 group_name: str | None, stats: bool) -> tuple[torch.Tensor, torch.Tensor]:
    call = _call(logits, target_ids, temperature, ignore_index, group_name)
    check_values("logp", call, target_ids, *logits.shape)
    split_id, impl = serving("logp", call)
    split = SPLITS.get(split_id)
    if stats and split is not None:
        return split[0](call)
    residual = torch.zeros((2, logits.shape[0] if stats else 0), dtype=torch.float32, device=logits.device)
    return impl(call), residual


@logp_forward.register_fake
def _(logits, target_ids, temperature, ignore_index, group_name, stats):
    num_tokens = logits.shape[0]
    return (logits.new_empty(num_tokens, dtype=torch.float32),
            logits.new_empty((2, num_tokens if stats else 0), dtype=torch.float32))


@torch.library.custom_op("rlk::logp_backward", mutates_args=())
def logp_backward(grad: torch.Tensor, logits: torch.Tensor, target_ids: torch.Tensor, residual: torch.Tensor,
                  temperature: float, ignore_index: int, group_name: str | None) -> torch.Tensor:
    call = _call(logits, target_ids, temperature, ignore_index, group_name)
    split_id, impl = serving("logp", call)
    split = SPLITS.get(split_id)
    if split is not None and residual.shape[1] == logits.shape[0]:
        return split[1](call, grad, residual)

    def forward(leaf: torch.Tensor) -> torch.Tensor:
        return impl(_call(leaf, target_ids, temperature, ignore_index, group_name))

    return recomputed_grads(forward, [logits], [True], [grad])[0]


@logp_backward.register_fake
def _(grad, logits, target_ids, residual, temperature, ignore_index, group_name):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, target_ids, temperature, ignore_index, group, _ = inputs
    ctx.save_for_backward(logits, target_ids, output[1])
    ctx.temperature, ctx.ignore_index, ctx.group_name = temperature, ignore_index, group
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad, _grad_residual):
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    logits, target_ids, residual = ctx.saved_tensors
    grad_logits = torch.ops.rlk.logp_backward(grad, logits, target_ids, residual, ctx.temperature, ctx.ignore_index,
                                              ctx.group_name)
    return grad_logits, None, None, None, None, None


logp_forward.register_autograd(_backward, setup_context=_setup_context)


def logp_op(call: LogpCall) -> torch.Tensor:
    """The checked ``call`` through ``torch.ops.rlk.logp``."""
    stats = needs_grad(call.logits)[0]
    return torch.ops.rlk.logp(call.logits, call.target_ids, call.temperature, call.ignore_index,
                              registered_name(call.tp_group), stats)[0]


__all__ = ["SPLITS", "logp_backward", "logp_forward", "logp_op"]
