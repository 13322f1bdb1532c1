"""Test-only kernel backends with one injected fault each: what the A/B gates exist to catch.

Each is ``rlk-triton`` with one op changed, chosen by dotted path like any third-party backend
(``VIME_RL_KERNEL_BACKEND=suites.e2e.fault_backends:<factory>``, the arm's environment); the
fault's size comes from ``RLK_FAULT_SIZE`` in that environment (each factory's default
otherwise). The log-prob faults act on both log-prob ops TRL's LM head can use (``logp`` on the
logits and ``linear_logp`` on the hidden states), after the op:

================  ===============================================  ======================
factory           fault (size ``s``)                               gate it targets
================  ===============================================  ======================
``logp_bias``     every log-prob ``+ s``                           ``train_rollout_logprob_abs_diff``
``grad_scale``    the log-prob's gradient ``x s`` on odd tokens     replay loss / grad norm; live reward, KL
``grad_flip``     the gradient's sign flipped on a share ``s``      replay loss / grad norm; live reward, KL
``slow_logp``     the op's work ``x (1 + s)`` (a share ``s`` again)  step time
``extra_buffer``  an extra [T, V] fp32 tensor per call, held        peak VRAM
                  until the backward (``s`` copies)
================  ===============================================  ======================

Nothing in the product knows of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from kernels.backends.triton import TritonBackend

MODULE = "suites.e2e.fault_backends"
SIZE_ENV = "RLK_FAULT_SIZE"
LOGP_OPS = ("logp", "linear_logp")


def dotted_path(factory: str) -> str:
    return f"{MODULE}:{factory}"


def fault_size(default: float) -> float:
    raw = os.environ.get(SIZE_ENV)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{SIZE_ENV}={raw!r}: expected a number (the injected fault's size)") from None


class _GradMask(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor`` ([T] or a scalar)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(factor)
        return values.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (factor,) = ctx.saved_tensors
        return grad * factor, None


class _HeldBuffer(torch.autograd.Function):
    """Identity, holding ``buffer`` (saved for the backward) from the forward to the backward."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(buffer)
        return values.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _shape(call: Any) -> tuple[int, int]:
    """(T, V) of a logp or linear_logp call."""
    if hasattr(call, "logits"):
        return call.logits.shape[0], call.logits.shape[1]
    return call.hidden.shape[0], call.weight.shape[0]


class FaultBackend(TritonBackend):
    """``rlk-triton`` with ``fault(op, impl, call)`` serving the log-prob ops."""

    def __init__(self, name: str, size: float, fault: Callable[[Callable, Any], torch.Tensor]) -> None:
        super().__init__()
        self.id = f"rlk-test-fault-{name}"
        self.version = f"{super().version}+{name}{size:g}"
        self.size = size
        self._fault = fault

    def get(self, op: str) -> Callable[..., Any]:
        impl = super().get(op)
        if op not in LOGP_OPS:
            return impl
        return lambda call: self._fault(impl, call)


def logp_bias() -> FaultBackend:
    size = fault_size(1e-2)
    return FaultBackend("logp-bias", size, lambda impl, call: impl(call) + size)


def grad_scale() -> FaultBackend:
    size = fault_size(0.5)

    def fault(impl, call):
        out = impl(call)
        factor = torch.ones_like(out)
        factor[1::2] = size
        return _GradMask.apply(out, factor)

    return FaultBackend("grad-scale", size, fault)


def grad_flip() -> FaultBackend:
    size = fault_size(0.05)

    def fault(impl, call):
        out = impl(call)
        tokens = torch.arange(out.shape[0], device=out.device)
        # a fixed, spread-out share of the tokens (Knuth's multiplicative hash of the position)
        chosen = ((tokens * 2654435761) % 1000) < size * 1000
        return _GradMask.apply(out, torch.where(chosen, -1.0, 1.0).to(out.dtype))

    return FaultBackend("grad-flip", size, fault)


def slow_logp() -> FaultBackend:
    size = fault_size(0.2)

    def fault(impl, call):
        out = impl(call)
        with torch.no_grad():  # the same op again on a share of the calls' work
            for _ in range(int(size)):
                impl(call)
            rest = size - int(size)
            if rest > 0:
                rows = max(1, int(_shape(call)[0] * rest))
                impl(_rows(call, rows))
        return out

    return FaultBackend("slow", size, fault)


def _rows(call: Any, rows: int) -> Any:
    """The call on its first ``rows`` tokens (a logp or linear_logp call, rebuilt and checked)."""
    from kernels.contracts.linear_logp import LinearLogpCall
    from kernels.contracts.logp import LogpCall

    if hasattr(call, "logits"):
        return LogpCall(call.logits[:rows].detach(), call.target_ids[:rows], call.temperature)
    return LinearLogpCall(call.hidden[:rows].detach(), call.weight.detach(), call.target_ids[:rows],
                          None if call.bias is None else call.bias.detach(), call.temperature)


def extra_buffer() -> FaultBackend:
    size = fault_size(1.0)

    def fault(impl, call):
        out = impl(call)
        if not torch.is_grad_enabled() or not out.requires_grad:
            return out
        tokens, vocab = _shape(call)
        buffer = torch.empty((max(1, int(size * tokens)), vocab), dtype=torch.float32, device=out.device)
        return _HeldBuffer.apply(out, buffer)

    return FaultBackend("extra-buffer", size, fault)


FAULTS = {name: dotted_path(name) for name in ("logp_bias", "grad_scale", "grad_flip", "slow_logp", "extra_buffer")}
