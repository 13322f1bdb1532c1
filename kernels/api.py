"""The public API of the ops: ``kernels.logp``, ``kernels.ratio_kl``, ``kernels.grpo_loss``, ``kernels.linear_logp``.

Each function's parameters, shapes, dtypes and checks are its contract's (kernels/contracts/):
a call is checked once, here, then runs on the implementation :mod:`kernels.dispatch` picks (the
fp32 reference by default; ``VIME_RL_KERNEL=1`` turns on the kernel backend), so a bad input is
an error naming it on every backend, never a fallback. The checks that read device data (ids
range, packed lengths) run in the kernels of a backend that checks them on the device, else on the
host before the backend runs (:func:`kernels.dispatch.run`).

``logp`` and ``ratio_kl`` try their serving backend's host-first entry before the call is built
(:func:`kernels.dispatch.run_host_first`): the C++ host path of a common-case call checks what it
relies on itself, serves the call with the bits the checked call gets, and declines the rest.

Under ``torch.compile`` a checked call goes through its PyTorch operator (``torch.ops.rlk.<op>``,
kernels/library/), whose implementation runs the same dispatch and value checks per call: the
compiler traces it without a graph break. An eager call skips the operator layer (its host time)
for the same bits.
"""

from __future__ import annotations

import functools

import torch

from kernels import dispatch, library
from kernels.contracts import (
    GrpoLossCall,
    LinearLogpCall,
    LogpCall,
    RatioKLCall,
    entry_point,
)


def _logp(call: LogpCall) -> torch.Tensor:
    """Selected log-prob of each row's target: logits [T, V] -> fp32 [T] (kernels/contracts/logp.py)."""
    if torch.compiler.is_compiling():
        return library.logp_op(call)
    return dispatch.run("logp", call)


def _ratio_kl(call: RatioKLCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, kl), fp32 [T] each, from fp32 [T] log-probs (kernels/contracts/ratio_kl.py)."""
    if torch.compiler.is_compiling():
        return library.ratio_kl_op(call)
    return dispatch.run("ratio_kl", call)


def _grpo_loss(call: GrpoLossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's GRPO loss from logits -> (loss, {pg_loss, pg_clipfrac, ppo_kl, kl_loss})
    (kernels/contracts/grpo_loss.py)."""
    if torch.compiler.is_compiling():
        return library.grpo_loss_op(call)
    return dispatch.run("grpo_loss", call)


def _linear_logp(call: LinearLogpCall) -> torch.Tensor:
    """Selected log-prob of ``hidden @ weight.T (+ bias)`` without materializing the logits:
    hidden [T, H] -> fp32 [T] (kernels/contracts/linear_logp.py)."""
    if torch.compiler.is_compiling():
        return library.linear_logp_op(call)
    return dispatch.run("linear_logp", call)


# the ops whose calls of a few tokens are all host time ask the backend's host-first entry before
# building, checking and dispatching the call (grpo_loss's host path reads the checked call; its
# fwd+bwd host time is autograd's)
logp = entry_point(LogpCall, _logp, name="logp", checks_values=True,
                   first=functools.partial(dispatch.run_host_first, "logp"))
ratio_kl = entry_point(RatioKLCall, _ratio_kl, name="ratio_kl", checks_values=True,
                       first=functools.partial(dispatch.run_host_first, "ratio_kl"))
grpo_loss = entry_point(GrpoLossCall, _grpo_loss, name="grpo_loss", checks_values=True)
linear_logp = entry_point(LinearLogpCall, _linear_logp, name="linear_logp", checks_values=True)

__all__ = ["grpo_loss", "linear_logp", "logp", "ratio_kl"]
