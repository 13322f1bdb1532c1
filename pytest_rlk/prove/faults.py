"""Deliberately wrong kernel backends: ``rlk-triton`` with one fault of a stated kind and size.

Each is our Triton backend except for one op's output, gradient, reduction, support or cost, so a
gate that passes it has missed a real kernel bug of that size. They are chosen by name
(``FAULTS``) and loaded the ways any backend is:

- in-process, under the name the tests pin (``rlk-triton``): ``-p pytest_rlk.prove.inject
  --rlk-inject-fault NAME=SIZE`` (what ``rlk prove`` runs);
- in another process (an e2e arm, a vLLM or TRL worker), by dotted path:
  ``VIME_RL_KERNEL_BACKEND=pytest_rlk.prove.faults:make_backend`` with ``RLK_FAULT=NAME=SIZE``.

The backend keeps the id ``rlk-triton`` (the tests assert which backend served them) and says what
it is in its version: ``0.1.0+fault.logp_bias=0.001``. Its faulty ops are served through its own
``get`` on every path (the routes that bypass ``get``, the host-first entry and the operators'
splits, decline for an op whose ``get`` is not ours: ``TritonBackend.serves_own_routes``); its other
ops keep every route of ours, so a speed fault costs what it adds and nothing else.

The log-prob faults act on both log-prob ops (``logp`` on the logits, ``linear_logp`` on the hidden
states and the LM head: TRL's LM head runs either), after the op.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels import settings
from kernels.backends.triton import TritonBackend

FAULT_ENV = settings.FAULT.name
DOTTED_PATH = "pytest_rlk.prove.faults:make_backend"  # VIME_RL_KERNEL_BACKEND of another process


class _ScaleGradAtEvenTokens(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient of every other token by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scale = torch.ones_like(grad)
        scale[..., ::2] = ctx.factor
        return grad * scale, None


def _logp_bias(impl: Callable, size: float) -> Callable:
    return lambda call: impl(call) + size


def _logp_grad_scale_even(impl: Callable, size: float) -> Callable:
    return lambda call: _ScaleGradAtEvenTokens.apply(impl(call), 1.0 + size)


def _logp_grad_sign_even(impl: Callable, size: float) -> Callable:
    # size 1: the gradient of every other token turned around; 0: harmless
    return lambda call: _ScaleGradAtEvenTokens.apply(impl(call), 1.0 - 2.0 * size)


def _ratio_kl_bias(impl: Callable, size: float) -> Callable:
    def biased(call: Any) -> Any:
        ratio, kl = impl(call)
        return ratio, kl + size
    return biased


def _grpo_loss_scale(impl: Callable, size: float) -> Callable:
    def scaled(call: Any) -> Any:
        loss, metrics = impl(call)
        return loss * (1.0 + size), metrics
    return scaled


def _grpo_loss_wrong_reduction(impl: Callable, size: float) -> Callable:
    """size 1: the other reduction (per-token sum for vime's sum of sample means and back); 0: harmless."""
    def swapped(call: Any) -> Any:
        if not size:
            return impl(call)
        other = "per_token_sum" if call.config.reduction == "sum_of_sample_mean" else "sum_of_sample_mean"
        fields = {f.name: getattr(call, f.name) for f in dataclasses.fields(call) if f.init}
        fields["config"] = dataclasses.replace(call.config, reduction=other)
        return impl(type(call)(**fields))
    return swapped


def _grpo_metric_bias(impl: Callable, size: float) -> Callable:
    def biased(call: Any) -> Any:
        loss, metrics = impl(call)
        return loss, {**metrics, "ppo_kl": metrics["ppo_kl"] + size}
    return biased


def _tokens_vocab(call: Any) -> tuple[int, int]:
    """(T, V) of a logp or linear_logp call."""
    if hasattr(call, "logits"):
        return call.logits.shape[0], call.logits.shape[1]
    return call.hidden.shape[0], call.weight.shape[0]


def _first_rows(call: Any, rows: int) -> Any:
    """The same logp or linear_logp call on its first ``rows`` tokens, without autograd inputs."""
    if hasattr(call, "logits"):
        return type(call)(call.logits[:rows].detach(), call.target_ids[:rows], call.temperature)
    bias = None if call.bias is None else call.bias.detach()
    return type(call)(call.hidden[:rows].detach(), call.weight.detach(), call.target_ids[:rows], bias,
                      call.temperature)


def _logp_slowdown(impl: Callable, size: float) -> Callable:
    """``size`` times the op's work added to each call: whole extra calls, then one on the first
    ``frac(size) * T`` rows (1: twice the time of a device-bound call)."""
    def slow(call: Any) -> Any:
        with torch.no_grad():
            for _ in range(int(size)):
                impl(_first_rows(call, _tokens_vocab(call)[0]))
            rows = int((size - int(size)) * _tokens_vocab(call)[0])
            if rows:
                impl(_first_rows(call, rows))
        return impl(call)
    return slow


class _HeldUntilBackward(torch.autograd.Function):
    """Identity on ``x`` that holds ``buffer`` (saved for the backward) until the backward runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(buffer)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _logp_extra_buffer(impl: Callable, size: float) -> Callable:
    """A [T, V] fp32 buffer times ``size`` filled during the call and, where the output is
    differentiated, held until its backward (a forgotten upcast of the logits saved for the
    backward)."""
    def heavy(call: Any) -> Any:
        tokens, vocab = _tokens_vocab(call)
        device = (call.logits if hasattr(call, "logits") else call.hidden).device
        extra = torch.empty(max(1, int(size * tokens * vocab)), dtype=torch.float32, device=device)
        extra.fill_(0.0)
        out = impl(call)
        if torch.is_grad_enabled() and out.requires_grad:
            return _HeldUntilBackward.apply(out, extra)
        del extra
        return out
    return heavy


def _sleep(impl: Callable, size: float) -> Callable:
    """A host-side sleep of ``size`` seconds per call (a host sync, a Python loop)."""
    def slow(call: Any) -> Any:
        time.sleep(size)
        return impl(call)
    return slow


# name -> (op, wrapper(impl, size) -> impl); a fault of kind "declines" makes ``supports`` refuse.
# A ``logp`` fault applies to every op of LOGP_OPS.
LOGP_OPS = ("logp", "linear_logp")
WRAPPERS: dict[str, tuple[str, Callable[[Callable, float], Callable] | None]] = {
    "logp_bias": ("logp", _logp_bias),
    "logp_grad_scale_even": ("logp", _logp_grad_scale_even),
    "logp_grad_sign_even": ("logp", _logp_grad_sign_even),
    "ratio_kl_bias": ("ratio_kl", _ratio_kl_bias),
    "grpo_loss_scale": ("grpo_loss", _grpo_loss_scale),
    "grpo_loss_wrong_reduction": ("grpo_loss", _grpo_loss_wrong_reduction),
    "grpo_metric_bias": ("grpo_loss", _grpo_metric_bias),
    "grpo_loss_fallback": ("grpo_loss", None),
    "logp_slowdown": ("logp", _logp_slowdown),
    "logp_host_sleep": ("logp", _sleep),
    "logp_extra_buffer": ("logp", _logp_extra_buffer),
}


class FaultyTritonBackend(TritonBackend):
    """``rlk-triton`` with one fault (``WRAPPERS[fault]`` at ``size``)."""

    def __init__(self, fault: str, size: float) -> None:
        super().__init__()
        if fault not in WRAPPERS:
            raise ValueError(f"unknown fault {fault!r}; the faults: {', '.join(sorted(WRAPPERS))}")
        self.fault, self.size = fault, size
        self.op, self.wrap = WRAPPERS[fault]
        self.ops = LOGP_OPS if self.op == "logp" else (self.op,)
        self.version = f"{TritonBackend.version}+fault.{fault}={size:g}"

    def get(self, op: str) -> Callable[..., Any]:
        impl = super().get(op)
        if op not in self.ops or self.wrap is None:
            return impl
        return self.wrap(impl, self.size)


class DecliningTritonBackend(FaultyTritonBackend):
    """A fault of kind "declines": ``supports`` refuses the op (a fallback the gates must see)."""

    def supports(self, op: str, **case: Any) -> str | None:
        if op in self.ops and self.size:
            return f"fault {self.fault}: this backend declines {op} (a fallback the gates must see)"
        return super().supports(op, **case)


def faulty_backend(fault: str, size: float) -> FaultyTritonBackend:
    """The backend of ``fault`` at ``size``."""
    declines = fault in WRAPPERS and WRAPPERS[fault][1] is None
    return (DecliningTritonBackend if declines else FaultyTritonBackend)(fault, size)


def parse_fault(text: str) -> tuple[str, float]:
    """``NAME=SIZE`` -> (name, size); errors name the text and the known faults."""
    name, sep, size = text.partition("=")
    if not sep or name not in WRAPPERS:
        raise ValueError(f"fault {text!r}: expected NAME=SIZE with NAME one of {', '.join(sorted(WRAPPERS))}")
    try:
        value = float(size)
    except ValueError:
        raise ValueError(f"fault {text!r}: size {size!r} is not a number") from None
    return name, value


def arm_env(name: str, size: float) -> dict[str, str]:
    """The environment that makes another process's kernel backend this fault (an e2e arm's)."""
    return {"VIME_RL_KERNEL_BACKEND": DOTTED_PATH, FAULT_ENV: f"{name}={size!r}"}


def make_backend() -> FaultyTritonBackend:
    """The dotted-path factory: the fault ``RLK_FAULT=NAME=SIZE`` names (set by whoever injects it)."""
    text = settings.FAULT.get() or ""
    if not text:
        raise ValueError(f"{FAULT_ENV} is not set: pytest_rlk.prove.faults:make_backend needs "
                         f"{FAULT_ENV}=NAME=SIZE (one of {', '.join(sorted(WRAPPERS))})")
    return faulty_backend(*parse_fault(text))
