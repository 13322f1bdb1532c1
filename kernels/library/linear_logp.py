"""``torch.ops.rlk.linear_logp`` and ``torch.ops.rlk.linear_logp_backward``: the ``linear_logp`` op
(kernels/contracts/linear_logp.py).

rlk::linear_logp(hidden [T, H], weight [V, H], bias [V]?, target_ids [T], temperature, group_name?,
                 vocab_start, global_vocab, workspace_bytes?, needs_hidden, needs_weight, needs_bias,
                 layout int[4])
    -> (logp fp32 [T], stats fp32 [layout[0], T], kept [layout[1], layout[2]] (row stride layout[3]),
        hidden's dtype)
rlk::linear_logp_backward(grad fp32 [T], hidden, weight, bias?, target_ids, stats, kept, temperature,
                          group_name?, vocab_start, global_vocab, workspace_bytes?, needs_hidden,
                          needs_weight, needs_bias) -> (d_hidden, d_weight, d_bias)
    each in its input's dtype, or an empty tensor where not needed (or no bias).

``group_name``: the vocab-parallel group's registered name (``tp_group.group_name``), or None;
``weight`` is then this rank's shard of global ids ``[vocab_start, vocab_start + V_local)``.
``needs_*``: which inputs the caller differentiates (the forward keeps what that backward reads).

rlk-triton's split (``kernels.ops.linear_logp.split_forward`` / ``split_backward``): the forward
runs the eager call's kernels under the eager call's workspace plan and returns its residuals:
``stats`` (the row lse, the target logit, the kept vocab tiles' row maxima) and ``kept``, the kept
logits (q = exp(z - tile max)) in the plan's layout: a [V, T] view of the weight gradient's [V, H]
layout, a [T, kept columns] view of the workspace buffer, or none. The backward reads them and
runs the eager backward's pieces and products (three matrix products where every column is kept):
the eager bits, no forward rerun. It never writes them: an operator's output may not alias its
input, and AOTAutograd turns a saved tensor mutated in the backward into a copy plus the mutation,
so the eager call's reuse of the kept buffer (turned into dlogits in place, or its rows
overwritten by dW) becomes fresh memory: dW's [V, H] beside the kept [V, T] when they live in the
weight gradient (T * V * 2 bytes more at the backward's peak than the eager call at T = H), the
kept block's dlogits beside it in the workspace layout.

The layout depends on the plan (shapes, dtype, the budget and the settings) and on the backend the
switches configure: :func:`residual_layout`, which the public function computes as it is traced,
so the settings and switches it reads are the compiled graph's guards (a change recompiles) and
the layout the graph's constants (the fake states it; the real forward checks it). A dynamic token
count enters the plan's arithmetic as a symbol. Other backends, and the configured one falling
back, run the generic split (kernels/library/serve.py): the backward recomputes the forward with
autograd (one more ``hidden @ weight.T`` sweep); their residuals are unused (none but where the
configured backend falls back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import dispatch
from kernels.contracts import LinearLogpCall
from kernels.library.serve import (
    check_values,
    needs_grad,
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


def _triton_layout(call: LinearLogpCall, needs: tuple[bool, bool, bool]) -> tuple[int, tuple[int, int], int]:
    from kernels.ops.linear_logp import split_layout

    return split_layout(call, needs)


def _triton_forward(call: LinearLogpCall, needs: tuple[bool, bool, bool]):
    from kernels.ops.linear_logp import split_forward
    from kernels.ops.value_checks import launch_ids_check

    if call.deferred:  # the ids check the eager call runs first (kernels/ops/value_checks.py)
        launch_ids_check(call.target_ids, call.global_vocab, call.deferred)
    return split_forward(call, needs)


def _triton_backward(call: LinearLogpCall, grad: torch.Tensor, stats: torch.Tensor, kept: torch.Tensor,
                     needs: tuple[bool, bool, bool]):
    from kernels.ops.linear_logp import split_backward

    return split_backward(call, grad, stats, kept, needs)


@dataclass(frozen=True)
class Split:
    """A backend's split of linear_logp: ``layout(call, needs)`` -> (rows of ``stats``, shape of
    ``kept``, its row stride), the residuals ``forward(call, needs)`` -> (logp, stats, kept) returns
    when the caller differentiates ``needs`` (hidden, weight, bias); ``backward(call, grad, stats, kept,
    needs)`` -> (d_hidden, d_weight, d_bias), None where not needed."""
    layout: Callable[..., tuple[int, tuple[int, int], int]]
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor | None, ...]]


SPLITS = {"rlk-triton": Split(_triton_layout, _triton_forward, _triton_backward)}


def _layout(call: LinearLogpCall, needs: tuple[bool, bool, bool]) -> tuple[Split | None, list[int]]:
    """The split of the backend the switches configure for linear_logp (None: no split) and its
    residuals' layout, :func:`residual_layout`'s (none without a split), from the switches and
    settings read now."""
    on = dispatch.kernels_enabled() and dispatch.op_allowed("linear_logp")
    split = SPLITS.get(dispatch.configured_backend_name()) if on else None
    if split is None:
        return None, [0, 0, 0, 0]
    rows, shape, stride = split.layout(call, needs)
    return split, [rows, *shape, stride]


def residual_layout(call: LinearLogpCall, needs: tuple[bool, bool, bool]) -> list[int]:
    """[rows of ``stats``, rows and columns of ``kept``, its row stride]: the residuals the forward
    operator returns for ``call`` when the caller differentiates ``needs`` (hidden, weight, bias).
    The public function computes it while it is traced (the switches and settings it reads become
    the compiled graph's guards, the layout its constants), the fake states it, the real forward
    checks it against the plan it runs."""
    return _layout(call, needs)[1]


def _empty_residuals(hidden: torch.Tensor, layout: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, kept_rows, kept_cols, stride = layout
    return (hidden.new_empty((rows, hidden.shape[0]), dtype=torch.float32),
            hidden.new_empty_strided((kept_rows, kept_cols), (stride, 1)))


@torch.library.custom_op("rlk::linear_logp", mutates_args=())
def linear_logp_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        target_ids: torch.Tensor, temperature: float, group_name: str | None, vocab_start: int,
                        global_vocab: int, workspace_bytes: int | None, needs_hidden: bool, needs_weight: bool,
                        needs_bias: bool, layout: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = _call(hidden, weight, bias, target_ids, temperature, group_name, vocab_start, global_vocab,
                 workspace_bytes)
    check_values("linear_logp", call, target_ids, hidden.shape[0], global_vocab)
    needs = (needs_hidden, needs_weight, needs_bias)
    split, now = _layout(call, needs)
    if list(layout) != now:
        raise RuntimeError(
            f"rlk::linear_logp: called with the residual layout {list(layout)}, the switches and settings now "
            f"give {now} (kernels.library.linear_logp.residual_layout): a graph compiled under other settings")
    split_id, impl = serving("linear_logp", call)
    if split is not None and SPLITS.get(split_id) is split:
        return split.forward(call, needs)
    # another backend serves: a fallback from the configured one (its layout: residuals of that shape, unused)
    return impl(call), *_empty_residuals(hidden, layout)


@linear_logp_forward.register_fake
def _(hidden, weight, bias, target_ids, temperature, group_name, vocab_start, global_vocab, workspace_bytes,
      needs_hidden, needs_weight, needs_bias, layout):
    return hidden.new_empty(hidden.shape[0], dtype=torch.float32), *_empty_residuals(hidden, layout)


def _grad_or_empty(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if grad is None else grad


@torch.library.custom_op("rlk::linear_logp_backward", mutates_args=())
def linear_logp_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         target_ids: torch.Tensor, stats: torch.Tensor, kept: torch.Tensor, temperature: float,
                         group_name: str | None, vocab_start: int, global_vocab: int, workspace_bytes: int | None,
                         needs_hidden: bool, needs_weight: bool,
                         needs_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = (target_ids, temperature, group_name, vocab_start, global_vocab, workspace_bytes)
    call = _call(hidden, weight, bias, *rest)
    split_id, impl = serving("linear_logp", call)
    split = SPLITS.get(split_id)
    needs = [needs_hidden, needs_weight, needs_bias and bias is not None]
    if split is not None and stats.shape[0] >= 2:  # the split's forward ran: its residuals
        d_hidden, d_weight, d_bias = split.backward(call, grad, stats, kept, (needs_hidden, needs_weight, needs_bias))
    else:
        def forward(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            return impl(_call(h, w, b, *rest))

        d_hidden, d_weight, d_bias = recomputed_grads(forward, [hidden, weight, bias], needs, [grad])
    return _grad_or_empty(d_hidden, hidden), _grad_or_empty(d_weight, weight), _grad_or_empty(d_bias, hidden)


@linear_logp_backward.register_fake
def _(grad, hidden, weight, bias, target_ids, stats, kept, temperature, group_name, vocab_start, global_vocab,
      workspace_bytes, needs_hidden, needs_weight, needs_bias):
    return (torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if needs_weight else weight.new_empty(0),
            torch.empty_like(bias) if needs_bias and bias is not None else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target_ids, *rest = inputs
    _, stats, kept = output
    ctx.save_for_backward(hidden, weight, bias, target_ids, stats, kept)
    ctx.rest = rest[:5]  # temperature, group_name, vocab_start, global_vocab, workspace_bytes
    ctx.mark_non_differentiable(stats, kept)


def _backward(ctx, grad, _grad_stats, _grad_kept):
    hidden, weight, bias, target_ids, stats, kept = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if not any(needs):
        return (None,) * 13
    grads = torch.ops.rlk.linear_logp_backward(grad, hidden, weight, bias, target_ids, stats, kept, *ctx.rest,
                                               *needs)
    return (*(g if n else None for g, n in zip(grads, needs, strict=True)), *(None,) * 10)


linear_logp_forward.register_autograd(_backward, setup_context=_setup_context)


def linear_logp_op(call: LinearLogpCall) -> torch.Tensor:
    """The checked ``call`` through ``torch.ops.rlk.linear_logp``."""
    needs = tuple(needs_grad(call.hidden, call.weight, call.bias))
    logp, _, _ = torch.ops.rlk.linear_logp(call.hidden, call.weight, call.bias, call.target_ids, call.temperature,
                                           registered_name(call.tp_group), call.vocab_start, call.global_vocab,
                                           call.workspace_bytes, *needs, residual_layout(call, needs))
    return logp


__all__ = ["SPLITS", "Split", "linear_logp_backward", "linear_logp_forward", "linear_logp_op", "residual_layout"]
