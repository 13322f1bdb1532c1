"""``torch.ops.rlk.linear_logp`` and ``torch.ops.rlk.linear_logp_backward``: the ``linear_logp`` op
(kernels/contracts/linear_logp.py).

rlk::linear_logp(hidden [T, H], weight [V, H], bias [V]?, target_ids [T], temperature) -> logp fp32 [T]
rlk::linear_logp_backward(grad fp32 [T], hidden, weight, bias?, target_ids, temperature,
                          needs_hidden, needs_weight, needs_bias) -> (d_hidden, d_weight, d_bias)
    each in its input's dtype, or an empty tensor where not needed (or no bias).

Every backend runs the generic split (kernels/library/serve.py): the backward recomputes the
forward (one more ``hidden @ weight.T`` sweep; the kernel's own backward already recomputes the
logits chunk by chunk, so fwd+bwd runs four sweeps where the eager call runs three). A call with
a ``tp_group`` runs without the operators (an operator takes no process group).
"""

from __future__ import annotations

import torch

from kernels import dispatch
from kernels.contracts import LinearLogpCall
from kernels.library.serve import check_values, recomputed_grads, serving, trusted


def _call(hidden, weight, bias, target_ids, temperature: float) -> LinearLogpCall:
    return trusted(LinearLogpCall, hidden=hidden, weight=weight, target_ids=target_ids, bias=bias,
                   temperature=temperature, global_vocab=weight.shape[0], tp_world=1, deferred=0)


@torch.library.custom_op("rlk::linear_logp", mutates_args=())
def linear_logp_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        target_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    call = _call(hidden, weight, bias, target_ids, temperature)
    check_values("linear_logp", call, target_ids, hidden.shape[0], weight.shape[0])
    _, impl = serving("linear_logp", call)
    return impl(call)


@linear_logp_forward.register_fake
def _(hidden, weight, bias, target_ids, temperature):
    return hidden.new_empty(hidden.shape[0], dtype=torch.float32)


def _grad_or_empty(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if grad is None else grad


@torch.library.custom_op("rlk::linear_logp_backward", mutates_args=())
def linear_logp_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         target_ids: torch.Tensor, temperature: float, needs_hidden: bool, needs_weight: bool,
                         needs_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = _call(hidden, weight, bias, target_ids, temperature)
    _, impl = serving("linear_logp", call)

    def forward(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return impl(_call(h, w, b, target_ids, temperature))

    needs = [needs_hidden, needs_weight, needs_bias and bias is not None]
    d_hidden, d_weight, d_bias = recomputed_grads(forward, [hidden, weight, bias], needs, [grad])
    return _grad_or_empty(d_hidden, hidden), _grad_or_empty(d_weight, weight), _grad_or_empty(d_bias, hidden)


@linear_logp_backward.register_fake
def _(grad, hidden, weight, bias, target_ids, temperature, needs_hidden, needs_weight, needs_bias):
    return (torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if needs_weight else weight.new_empty(0),
            torch.empty_like(bias) if needs_bias and bias is not None else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target_ids, temperature = inputs
    ctx.save_for_backward(hidden, weight, bias, target_ids)
    ctx.temperature = temperature


def _backward(ctx, grad):
    hidden, weight, bias, target_ids = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if not any(needs):
        return None, None, None, None, None
    grads = torch.ops.rlk.linear_logp_backward(grad, hidden, weight, bias, target_ids, ctx.temperature, *needs)
    return (*(g if n else None for g, n in zip(grads, needs, strict=True)), None, None)


linear_logp_forward.register_autograd(_backward, setup_context=_setup_context)


def linear_logp_op(call: LinearLogpCall) -> torch.Tensor:
    """The checked ``call`` through ``torch.ops.rlk.linear_logp`` (a ``tp_group`` call: the dispatch directly)."""
    if call.tp_group is not None:
        return dispatch.run("linear_logp", call)
    return torch.ops.rlk.linear_logp(call.hidden, call.weight, call.bias, call.target_ids, call.temperature)


__all__ = ["linear_logp_backward", "linear_logp_forward", "linear_logp_op"]
