"""linear_logp's entry points: the autograd function and ``linear_logp_call`` (the eager op), and
the split forward / backward that ``torch.ops.rlk.linear_logp`` registers (kernels/library/linear_logp.py).

``linear_logp_call(call)``: ``call`` a ``LinearLogpCall`` (hidden [T, H], weight [V_local, H], bias
[V_local] or None, all fp32 | bf16 | fp16; target_ids [T] int64 | int32 with -100 ignored) -> logp fp32
[T], differentiable w.r.t. hidden, weight and bias. ``split_forward`` / ``split_backward`` return and
read the residuals ``split_layout`` states: stats fp32 [rows, T] and the kept q.
"""

from __future__ import annotations

import torch
import triton

from kernels import settings
from kernels.contracts import IGNORE_INDEX, LinearLogpCall, entry_point
from kernels.ops.linear_logp.launch import _local_ids
from kernels.ops.linear_logp.passes import _backward, _forward, _SavedLogits
from kernels.ops.linear_logp.plan import (
    KEEP_IN_WEIGHT_GRAD_ENV,
    SAVE_LOGITS_ENV,
    TILES_ENV,
    _keep_in_weight_grad,
    _Plan,
    _plan,
    _save_logits,
    _tile_config,
    _workspace_budget,
)


class _LinearLogpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, temperature, tp_group, vocab_start, plan, save):
        inv_temperature = 1.0 / temperature
        local_ids = _local_ids(target_ids, vocab_start)
        target_logit, lse, saved = _forward(hidden, weight, bias, local_ids, inv_temperature, tp_group,
                                            plan if save else None)
        ignored = target_ids == IGNORE_INDEX
        logp = torch.where(ignored, torch.zeros_like(lse), target_logit - lse)
        ctx.save_for_backward(hidden, weight, bias, local_ids, lse, ignored, target_logit)
        ctx.saved_logits = saved
        ctx.plan = plan
        ctx.inv_temperature = inv_temperature
        ctx.tp_group = tp_group
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, weight, bias, local_ids, lse, ignored, target_logit = ctx.saved_tensors
        saved, ctx.saved_logits = ctx.saved_logits, None  # consumed in place: a second backward recomputes
        grad_rows = torch.where(ignored, torch.zeros_like(lse), grad_logp.float())
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        d_hidden, d_weight, d_bias = _backward(
            hidden, weight, bias, local_ids, lse, grad_rows, target_logit, ctx.inv_temperature, ctx.tp_group,
            needs, ctx.plan, saved=saved,
        )
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None


def _operands(call: LinearLogpCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """hidden, weight and bias as the kernels read them: rows with unit stride along H."""
    hidden, weight, bias = call.hidden, call.weight, call.bias
    hidden_c = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight_c = weight if weight.stride(1) == 1 else weight.contiguous()
    return hidden_c, weight_c, None if bias is None else bias.contiguous()


def _call_plan(call: LinearLogpCall, needs: tuple[bool, bool, bool]) -> tuple[_Plan, bool]:
    """(plan, whether the forward keeps logits) of ``call`` when ``needs`` says which of hidden,
    weight and bias get a gradient: the budget and the settings read now."""
    budget, explicit = _workspace_budget(call.workspace_bytes)
    save = any(needs) and _save_logits()
    weight_grad = save and needs[1] and _keep_in_weight_grad()
    T, H = call.hidden.shape
    plan = _plan(T, H, call.weight.shape[0], call.hidden.dtype, budget, explicit=explicit, save=save,
                 tp=call.tp_group is not None, weight_grad=weight_grad)
    return plan, save


def linear_logp_call(call: LinearLogpCall) -> torch.Tensor:
    """Selected log-prob of ``target_ids`` under ``softmax((hidden @ weight.T + bias) / temperature)``
    on the kernels above: fp32 [T] on hidden's device, differentiable w.r.t. hidden, weight and bias.
    The workspace budget (``workspace_bytes``, else ``RLK_LINEAR_LOGP_WORKSPACE_BYTES``, else 256 MB)
    sets how much of the logits the forward keeps for the backward (module docstring)."""
    hidden_c, weight_c, bias_c = _operands(call)
    on = torch.is_grad_enabled()
    needs = tuple(on and t is not None and t.requires_grad for t in (hidden_c, weight_c, bias_c))
    plan, save = _call_plan(call, needs)
    return _LinearLogpFunction.apply(
        hidden_c, weight_c, bias_c, call.target_ids, call.temperature, call.tp_group, call.vocab_start, plan, save,
    )


# ----------------------------------------------------------------------------------------------
# The split for torch.ops.rlk.linear_logp (kernels/library/linear_logp.py): the forward returns what
# the backward reads; the backward reads it without writing it
# ----------------------------------------------------------------------------------------------


def split_layout(call: LinearLogpCall, needs: tuple[bool, bool, bool]) -> tuple[int, tuple[int, int], int]:
    """The residuals :func:`split_forward` returns for ``call`` when ``needs`` says which of hidden,
    weight and bias get a gradient, from the plan (shapes, dtype, budget and settings, read now):
    (rows of ``stats``, shape of ``kept``, row stride of ``kept``). No gradient: no residuals."""
    if not any(needs):
        return 0, (0, 0), 0
    plan, save = _call_plan(call, needs)
    T, H = call.hidden.shape
    block_v = _tile_config(call.hidden.dtype).block_v
    if not save or plan.saved_cols == 0:
        return 2, (0, 0), 0
    tiles = 2 + triton.cdiv(plan.saved_cols, block_v)
    if plan.in_weight_grad:
        return tiles, (call.weight.shape[0], T), H
    return tiles, (T, plan.saved_cols), plan.buffer_cols


def split_forward(call: LinearLogpCall, needs: tuple[bool, bool, bool]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """The forward of ``call`` without autograd, for a backward that gives ``needs`` (hidden, weight,
    bias) a gradient: (logp fp32 [T], stats fp32 [rows, T], kept) as :func:`split_layout` states them.
    ``stats``: the row lse, the target logit, then the row maxima of the kept vocab tiles; ``kept``:
    the kept q (``_saved_dtype``'s bits) as the plan lays it out: [T, saved_cols] (a view of the
    [T, buffer_cols] buffer), [V, T] (a view of the weight gradient's [V, H] layout: column v's q in
    row v), or [0, 0] where nothing is kept. The eager forward's kernels and plan: the same bits."""
    hidden, weight, bias = _operands(call)
    plan, save = _call_plan(call, needs)
    local_ids = _local_ids(call.target_ids, call.vocab_start)
    target_logit, lse, saved = _forward(hidden, weight, bias, local_ids, 1.0 / call.temperature, call.tp_group,
                                        plan if save else None)
    ignored = call.target_ids == IGNORE_INDEX
    logp = torch.where(ignored, torch.zeros_like(lse), target_logit - lse)
    T = hidden.shape[0]
    nothing = hidden.new_empty_strided((0, 0), (0, 1))
    if not any(needs):
        return logp, lse.new_empty((0, T)), nothing
    if saved is None:
        return logp, torch.stack([lse, target_logit]), nothing
    # the kept columns only (a view: the unused columns hold no values)
    kept = saved.buffer[:, :saved.cols] if saved.weight_grad is None else saved.weight_grad[:, :T]
    return logp, torch.cat([lse.view(1, T), target_logit.view(1, T), saved.tile_max]), kept


def split_backward(call: LinearLogpCall, grad_logp: torch.Tensor, stats: torch.Tensor, kept: torch.Tensor,
                   needs: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, ...]:
    """(dH, dW, db) (None where ``needs`` is false) of :func:`split_forward`'s call from its ``stats``
    and ``kept``, read and never written: the eager backward's pieces and products (the same bits),
    the kept block's dlogits and dW in fresh memory. The plan is made again from the same budget and
    settings; residuals that do not match it (a setting changed between the forward and its
    backward) are an error."""
    hidden, weight, bias = _operands(call)
    plan, _ = _call_plan(call, needs)
    rows, shape, _ = split_layout(call, needs)
    if tuple(kept.shape) != shape or stats.shape[0] != rows:
        raise RuntimeError(
            f"linear_logp's backward: the forward kept logits {tuple(kept.shape)} and statistics "
            f"{tuple(stats.shape)}, the plan now gives {shape} and {(rows, stats.shape[1])}: the workspace budget "
            f"or a setting ({settings.LINEAR_LOGP_WORKSPACE_BYTES.name}, {SAVE_LOGITS_ENV}, "
            f"{KEEP_IN_WEIGHT_GRAD_ENV}, {TILES_ENV}) changed between the forward and its backward")
    block_v = _tile_config(hidden.dtype).block_v
    tiles = rows - 2
    lse, target_logit = stats[0], stats[1]
    saved = None
    if tiles:
        in_grad = plan.in_weight_grad
        saved = _SavedLogits(buffer=None if in_grad else kept, tile_max=stats[2:], cols=plan.saved_cols,
                             block_v=block_v, weight_grad=kept if in_grad else None)
    local_ids = _local_ids(call.target_ids, call.vocab_start)
    ignored = call.target_ids == IGNORE_INDEX
    grad_rows = torch.where(ignored, torch.zeros_like(lse), grad_logp.float())
    needs = (needs[0], needs[1], bias is not None and needs[2])
    return _backward(hidden, weight, bias, local_ids, lse, grad_rows, target_logit, 1.0 / call.temperature,
                     call.tp_group, needs, plan, saved=saved, consume=False)


linear_logp = entry_point(LinearLogpCall, linear_logp_call, name="linear_logp")
