"""fp32 reference of linear_logp (kernels/contracts/linear_logp.py): selected log-prob from hidden
states and the LM head.

    z = (hidden.float() @ weight.float().T + bias.float()) / temperature
    logp[t] = log_softmax(z)[t, id_t]

Why the fp32 upcast *before* the matmul: the oracle must not carry the error it is meant to
detect. A bf16 matmul (cuBLAS with bf16 output, what an eager ``F.linear`` in bf16 gives) rounds every
logit to 8 mantissa bits: at |z| ~ 20 that is ~0.06 per logit, and the log-softmax of V = 152k such
rounded logits drifts ~7.6e-3 from the exact result (docs/linear_logp.md). A
kernel that accumulates in fp32 is ~1e-5 from the fp32 result; judged against a bf16 reference it
would look 7.6e-3 wrong, and a kernel as sloppy as the bf16 path would look perfect. With fp32
operands every product of two bf16 numbers is exact, so only the fp32 summation order differs.

Vocab-parallel (``tp_group``): this rank holds rows ``[vocab_start, vocab_start + V_local)`` of the
LM head, in Megatron's equal-shard layout (``vocab_start == rank * ceil(global_vocab / world)``,
the last shard may be shorter). The log-softmax is the shared vocab-parallel reference
(kernels/reference/logprob.py) on this rank's fp32 logits, padded with ``-inf`` columns to the
common shard width (they take no probability and no gradient). The hidden states are replicated
over the TP group, so their gradient is all-reduced (SUM) as Megatron's ColumnParallelLinear input
region does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from kernels.contracts import IGNORE_INDEX, LinearLogpCall, entry_point
from kernels.reference.logprob import _selected_logprob, _vocab_parallel_selected_logprob


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the TP group (replicated input)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[T, V_local] fp32 logits from fp32 copies of hidden [T, H], weight [V_local, H], bias [V_local]."""
    logits = hidden.float() @ weight.float().t()
    return logits if bias is None else logits + bias.float()


def linear_logp_call(call: LinearLogpCall) -> torch.Tensor:
    """fp32 reference: [T] log-probs, autograd to hidden, weight and bias (grads in their own dtypes).
    Materializes [T, V_local] fp32 logits: small shapes only."""
    hidden, weight, bias, target_ids = call.hidden, call.weight, call.bias, call.target_ids
    if call.tp_group is None:
        return _selected_logprob(fp32_logits(hidden, weight, bias), target_ids, call.temperature, IGNORE_INDEX)
    world = dist.get_world_size(call.tp_group)
    rank = dist.get_rank(call.tp_group)
    shard_width = math.ceil(call.global_vocab / world)
    if call.vocab_start != rank * shard_width or weight.shape[0] > shard_width:
        raise ValueError(
            f"the reference supports Megatron's equal-shard layout only: rank {rank} of {world} must start "
            f"at vocab_start={rank * shard_width} with V_local <= {shard_width}, got vocab_start={call.vocab_start}, "
            f"V_local={weight.shape[0]}"
        )
    hidden_region = _CopyToTensorParallelRegion.apply(hidden, call.tp_group)
    logits = fp32_logits(hidden_region, weight, bias)
    pad = shard_width - logits.shape[1]
    if pad:
        logits = torch.cat([logits, logits.new_full((logits.shape[0], pad), float("-inf"))], dim=1)
    return _vocab_parallel_selected_logprob(logits, target_ids, call.temperature, call.tp_group, IGNORE_INDEX)


linear_logp = entry_point(LinearLogpCall, linear_logp_call, name="linear_logp")

__all__ = ["fp32_logits", "linear_logp", "linear_logp_call"]
