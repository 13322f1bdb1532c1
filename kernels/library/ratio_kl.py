"""``torch.ops.rlk.ratio_kl`` and ``torch.ops.rlk.ratio_kl_backward``: the ``ratio_kl`` op
(kernels/contracts/ratio_kl.py).

rlk::ratio_kl(logp fp32 [T], old_logp [T], ref_logp [T], mask [T], kl_type, use_unbiased_kl) -> (ratio fp32 [T], kl fp32 [T])
rlk::ratio_kl_backward(grad_ratio [T], grad_kl [T], logp, old_logp, ref_logp, mask, kl_type, use_unbiased_kl) -> dlogp fp32 [T]

rlk-triton's split: the forward kernel, and the backward kernel from the saved inputs (its own
backward). Other backends run the generic split (kernels/library/serve.py): the backward
recomputes the forward with autograd, T elements.
"""

from __future__ import annotations

import torch

from kernels.contracts import RatioKLCall
from kernels.library.serve import recomputed_grads, serving, trusted


def _triton_backward(call: RatioKLCall, grad_ratio: torch.Tensor, grad_kl: torch.Tensor) -> torch.Tensor:
    from kernels.ops.ratio_kl import kl_type_code, ratio_kl_backward

    return ratio_kl_backward(call.logp.contiguous(), call.old_logp.contiguous(), call.ref_logp.contiguous(),
                             call.mask.contiguous(), grad_ratio, grad_kl, kl_type_code(call.kl_type),
                             call.use_unbiased_kl)


# backend id -> backward(call, grad_ratio, grad_kl) -> dlogp (the forward is the backend's own:
# an operator's inputs never require grad inside it, so it records nothing)
BACKWARD_SPLITS = {"rlk-triton": _triton_backward}


def _call(logp, old_logp, ref_logp, mask, kl_type: str, use_unbiased_kl: bool) -> RatioKLCall:
    return trusted(RatioKLCall, logp=logp, old_logp=old_logp, ref_logp=ref_logp, mask=mask, kl_type=kl_type,
                   use_unbiased_kl=use_unbiased_kl)


@torch.library.custom_op("rlk::ratio_kl", mutates_args=())
def ratio_kl_forward(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                     kl_type: str, use_unbiased_kl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    call = _call(logp, old_logp, ref_logp, mask, kl_type, use_unbiased_kl)
    _, impl = serving("ratio_kl", call)
    return impl(call)


@ratio_kl_forward.register_fake
def _(logp, old_logp, ref_logp, mask, kl_type, use_unbiased_kl):
    return torch.empty_like(logp, dtype=torch.float32), torch.empty_like(logp, dtype=torch.float32)


@torch.library.custom_op("rlk::ratio_kl_backward", mutates_args=())
def ratio_kl_backward(grad_ratio: torch.Tensor, grad_kl: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor,
                      ref_logp: torch.Tensor, mask: torch.Tensor, kl_type: str,
                      use_unbiased_kl: bool) -> torch.Tensor:
    call = _call(logp, old_logp, ref_logp, mask, kl_type, use_unbiased_kl)
    split_id, impl = serving("ratio_kl", call)
    split = BACKWARD_SPLITS.get(split_id)
    if split is not None:
        return split(call, grad_ratio, grad_kl)

    def forward(leaf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return impl(_call(leaf, old_logp, ref_logp, mask, kl_type, use_unbiased_kl))

    return recomputed_grads(forward, [logp], [True], [grad_ratio, grad_kl])[0]


@ratio_kl_backward.register_fake
def _(grad_ratio, grad_kl, logp, old_logp, ref_logp, mask, kl_type, use_unbiased_kl):
    return torch.empty_like(logp)


def _setup_context(ctx, inputs, output):
    logp, old_logp, ref_logp, mask, kl_type, use_unbiased_kl = inputs
    ctx.save_for_backward(logp, old_logp, ref_logp, mask)
    ctx.kl_type, ctx.use_unbiased_kl = kl_type, use_unbiased_kl


def _backward(ctx, grad_ratio, grad_kl):
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    logp, old_logp, ref_logp, mask = ctx.saved_tensors
    grad = torch.ops.rlk.ratio_kl_backward(grad_ratio, grad_kl, logp, old_logp, ref_logp, mask, ctx.kl_type,
                                           ctx.use_unbiased_kl)
    return grad, None, None, None, None, None


ratio_kl_forward.register_autograd(_backward, setup_context=_setup_context)


def ratio_kl_op(call: RatioKLCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked ``call`` through ``torch.ops.rlk.ratio_kl``."""
    return torch.ops.rlk.ratio_kl(call.logp, call.old_logp, call.ref_logp, call.mask, call.kl_type,
                                  call.use_unbiased_kl)


__all__ = ["BACKWARD_SPLITS", "ratio_kl_backward", "ratio_kl_forward", "ratio_kl_op"]
