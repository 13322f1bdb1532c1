"""``torch.ops.rlk.linear_logp`` and ``torch.ops.rlk.linear_logp_backward``: the ``linear_logp`` op
(kernels/contracts/linear_logp.py).

rlk::linear_logp(hidden [T, H], weight [V, H], bias [V]?, target_ids [T], temperature, group_name?,
                 vocab_start, global_vocab, workspace_bytes?) -> logp fp32 [T]
rlk::linear_logp_backward(grad fp32 [T], hidden, weight, bias?, target_ids, temperature, group_name?,
                          vocab_start, global_vocab, workspace_bytes?, needs_hidden, needs_weight,
                          needs_bias) -> (d_hidden, d_weight, d_bias)
    each in its input's dtype, or an empty tensor where not needed (or no bias).

``group_name``: the vocab-parallel group's registered name (``tp_group.group_name``), or None;
``weight`` is then this rank's shard of global ids ``[vocab_start, vocab_start + V_local)``.

Every backend runs the generic split (kernels/library/serve.py): the backward recomputes the
forward with autograd (one more ``hidden @ weight.T`` sweep; the kernel's own backward already
recomputes the logits that its workspace does not keep). A split for rlk-triton would return
what its forward keeps for the backward (the kept logits, whose width its workspace plan
decides at run time) as residuals.
"""

from __future__ import annotations

import torch

from kernels.contracts import LinearLogpCall
from kernels.library.serve import (
    check_values,
    recomputed_grads,
    registered_name,
    serving,
    tp_fields,
    trusted,
)


def _call(hidden, weight, bias, target_ids, temperature: float, group: str | None, vocab_start: int,
          global_vocab: int, workspace_bytes: int | None) -> LinearLogpCall:
    return trusted(LinearLogpCall, hidden=hidden, weight=weight, target_ids=target_ids, bias=bias,
                   temperature=temperature, vocab_start=vocab_start, global_vocab=global_vocab,
                   workspace_bytes=workspace_bytes, deferred=0, **tp_fields(group))


@torch.library.custom_op("rlk::linear_logp", mutates_args=())
def linear_logp_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        target_ids: torch.Tensor, temperature: float, group_name: str | None, vocab_start: int,
                        global_vocab: int, workspace_bytes: int | None) -> torch.Tensor:
    call = _call(hidden, weight, bias, target_ids, temperature, group_name, vocab_start, global_vocab,
                 workspace_bytes)
    check_values("linear_logp", call, target_ids, hidden.shape[0], global_vocab)
    _, impl = serving("linear_logp", call)
    return impl(call)


@linear_logp_forward.register_fake
def _(hidden, weight, bias, target_ids, temperature, group_name, vocab_start, global_vocab, workspace_bytes):
    return hidden.new_empty(hidden.shape[0], dtype=torch.float32)


def _grad_or_empty(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if grad is None else grad


@torch.library.custom_op("rlk::linear_logp_backward", mutates_args=())
def linear_logp_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         target_ids: torch.Tensor, temperature: float, group_name: str | None, vocab_start: int,
                         global_vocab: int, workspace_bytes: int | None, needs_hidden: bool, needs_weight: bool,
                         needs_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = (target_ids, temperature, group_name, vocab_start, global_vocab, workspace_bytes)
    _, impl = serving("linear_logp", _call(hidden, weight, bias, *rest))

    def forward(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return impl(_call(h, w, b, *rest))

    needs = [needs_hidden, needs_weight, needs_bias and bias is not None]
    d_hidden, d_weight, d_bias = recomputed_grads(forward, [hidden, weight, bias], needs, [grad])
    return _grad_or_empty(d_hidden, hidden), _grad_or_empty(d_weight, weight), _grad_or_empty(d_bias, hidden)


@linear_logp_backward.register_fake
def _(grad, hidden, weight, bias, target_ids, temperature, group_name, vocab_start, global_vocab, workspace_bytes,
      needs_hidden, needs_weight, needs_bias):
    return (torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if needs_weight else weight.new_empty(0),
            torch.empty_like(bias) if needs_bias and bias is not None else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target_ids, *rest = inputs
    ctx.save_for_backward(hidden, weight, bias, target_ids)
    ctx.rest = rest  # temperature, group_name, vocab_start, global_vocab, workspace_bytes


def _backward(ctx, grad):
    hidden, weight, bias, target_ids = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if not any(needs):
        return (None,) * 9
    grads = torch.ops.rlk.linear_logp_backward(grad, hidden, weight, bias, target_ids, *ctx.rest, *needs)
    return (*(g if n else None for g, n in zip(grads, needs, strict=True)), *(None,) * 6)


linear_logp_forward.register_autograd(_backward, setup_context=_setup_context)


def linear_logp_op(call: LinearLogpCall) -> torch.Tensor:
    """The checked ``call`` through ``torch.ops.rlk.linear_logp``."""
    return torch.ops.rlk.linear_logp(call.hidden, call.weight, call.bias, call.target_ids, call.temperature,
                                     registered_name(call.tp_group), call.vocab_start, call.global_vocab,
                                     call.workspace_bytes)


__all__ = ["linear_logp_backward", "linear_logp_forward", "linear_logp_op"]
