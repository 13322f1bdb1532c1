"""fp32 references of vime's selected log-prob (single device and vocab-parallel).

Formula (vime, "Training-side math"): with ``z = logits.float() / temperature`` (the division is
skipped when ``temperature == 1``, as in vime), ``m = max_v z_v``, ``S = sum_v exp(z_v - m)``,
``logp_t = (z_{t, id_t} - m) - log S``. Gradient: ``d logp_t / d logits_{t,v} =
(1[v = id_t] - softmax(z_t)_v) / temperature``. Rows whose id equals ``ignore_index`` give
``logp = 0`` and zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.contracts import IGNORE_INDEX, LogpCall
from kernels.contracts.checks import check_logits, check_target_ids, check_temperature


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


def selected_logprob(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Log-prob of each row's target token.

    logits: [T, V] float32|bfloat16|float16 (upcast to fp32 first); target_ids: [T] int64|int32;
    temperature: float > 0. Returns fp32 [T], differentiable w.r.t. ``logits``.
    """
    num_tokens, vocab = check_logits(logits)
    temperature = check_temperature(temperature)
    check_target_ids(target_ids, num_tokens, vocab, logits.device, ignore_index)
    return _selected_logprob(logits, target_ids, temperature, ignore_index)


def _selected_logprob(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float,
                      ignore_index: int) -> torch.Tensor:
    z = _scaled(logits, temperature)
    ignored = target_ids == ignore_index
    safe_ids = torch.where(ignored, torch.zeros_like(target_ids), target_ids).long()
    m = z.max(dim=-1, keepdim=True).values.detach()  # the max shift carries no gradient (as in vime)
    shifted = z - m
    log_s = shifted.exp().sum(dim=-1).log()
    target = shifted.gather(-1, safe_ids[:, None]).squeeze(-1)
    logp = target - log_s
    return torch.where(ignored, torch.zeros_like(logp), logp)


class _VocabParallelLogprob(torch.autograd.Function):
    """Autograd for the vocab-parallel reference: the gradient is local to each shard."""

    @staticmethod
    def forward(ctx, z_local, safe_local_ids, owned, ignored, group):  # type: ignore[override]
        m = z_local.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = z_local - m[:, None]
        exp_shifted = shifted.exp()
        s = exp_shifted.sum(dim=-1)
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
        target = shifted.gather(-1, safe_local_ids[:, None]).squeeze(-1)
        target = torch.where(owned, target, torch.zeros_like(target))
        dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group)
        logp = torch.where(ignored, torch.zeros_like(target), target - s.log())
        softmax = exp_shifted / s[:, None]
        ctx.save_for_backward(softmax, safe_local_ids, owned, ignored)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):  # type: ignore[override]
        softmax, safe_local_ids, owned, ignored = ctx.saved_tensors
        g = torch.where(ignored, torch.zeros_like(grad_logp), grad_logp)
        grad = -softmax * g[:, None]
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows[owned], safe_local_ids[owned]] += g[owned]
        return grad, None, None, None, None


def vocab_parallel_selected_logprob(
    logits_local: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Selected log-prob with the vocab split over the ranks of ``tp_group``.

    logits_local: [T, V_local] (this rank owns global ids ``[rank*V_local, (rank+1)*V_local)``);
    target_ids: [T] global ids in ``[0, world*V_local)``. Communication (all O(T)): all-reduce MAX
    of the row max, SUM of the sum of exponentials, SUM of the target term (non-zero only on the
    owning shard). Returns fp32 [T] (identical on every rank); gradient to ``logits_local`` is
    ``(1[v = id] - softmax_v) / temperature`` restricted to the shard.
    """
    num_tokens, vocab_local = check_logits(logits_local, "logits_local")
    temperature = check_temperature(temperature)
    world = dist.get_world_size(tp_group)
    check_target_ids(target_ids, num_tokens, vocab_local * world, logits_local.device, ignore_index)
    return _vocab_parallel_selected_logprob(logits_local, target_ids, temperature, tp_group, ignore_index)


def _vocab_parallel_selected_logprob(logits_local: torch.Tensor, target_ids: torch.Tensor, temperature: float,
                                     tp_group: dist.ProcessGroup | None, ignore_index: int) -> torch.Tensor:
    vocab_local = logits_local.shape[1]
    vocab_start = dist.get_rank(tp_group) * vocab_local
    ignored = target_ids == ignore_index
    owned = (~ignored) & (target_ids >= vocab_start) & (target_ids < vocab_start + vocab_local)
    safe_local_ids = torch.where(owned, target_ids - vocab_start, torch.zeros_like(target_ids)).long()
    z_local = _scaled(logits_local, temperature)
    return _VocabParallelLogprob.apply(z_local, safe_local_ids, owned, ignored, tp_group)


def logp_call(call: LogpCall) -> torch.Tensor:
    """The ``logp`` op (kernels/contracts/logp.py) on the references above; the call is checked."""
    if call.tp_group is None:
        return _selected_logprob(call.logits, call.target_ids, call.temperature, call.ignore_index)
    return _vocab_parallel_selected_logprob(call.logits, call.target_ids, call.temperature, call.tp_group,
                                            call.ignore_index)
