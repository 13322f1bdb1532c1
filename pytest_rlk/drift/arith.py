"""The ``arith`` factor: one function per way of turning logits (or hidden states) into log-probs.

Every path goes through the public ``kernels`` API with vime's switches (``VIME_RL_KERNEL``,
``VIME_RL_KERNEL_STRICT``, ``VIME_RL_KERNEL_BACKEND``), set for the call and restored after it.
Kernel paths run strict: a fallback to the reference raises instead of silently measuring the
reference twice. ``kernels`` follows ``VIME_RL_KERNEL_BACKEND`` when it is set (``rlk-triton``
otherwise), which is how a user's backend, or a deliberately perturbed one, enters rung A1.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist


class SideUnavailable(RuntimeError):
    """A side that cannot run on this machine (a package or a device is missing); the reason names it."""


@contextlib.contextmanager
def kernel_switches(on: bool, backend: str | None = None) -> Iterator[None]:
    """Kernels on (strict, all ops; ``backend`` if given, else the configured one) or off."""
    switches = {"VIME_RL_KERNEL": "1" if on else "0", "VIME_RL_KERNEL_STRICT": "1" if on else "0"}
    if backend is not None:
        switches["VIME_RL_KERNEL_BACKEND"] = backend
    with mock.patch.dict(os.environ, switches):  # the whole environment is restored on exit
        os.environ.pop("VIME_RL_KERNEL_OPS", None)
        yield


@contextlib.contextmanager
def _unservable() -> Iterator[None]:
    """A strict-mode fallback (the backend cannot serve this case: an op it lacks, a device, a
    dtype) makes the side unavailable, with the dispatcher's reason; it is never measured as the
    reference under the kernel's name."""
    from kernels import KernelFallbackError

    try:
        yield
    except KernelFallbackError as exc:
        raise SideUnavailable(str(exc)) from exc


def _backend_for(arith: str) -> tuple[bool, str | None]:
    return {"reference": (False, None), "kernels": (True, None), "kernels-linear": (True, None),
            "liger": (True, "liger")}[arith]


def logp_from_logits(arith: str, logits: torch.Tensor, ids: torch.Tensor, temperature: float, *,
                     tp_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, str]:
    """(fp32 log-probs [R], the implementation's id) of ``ids`` under ``logits`` [R, V(_local)]."""
    import kernels

    if arith == "megatron":
        return _megatron_logp(logits, ids, temperature)
    if arith == "kernels-linear":
        raise ValueError("kernels-linear reads hidden states: use logp_from_hidden")
    on, backend = _backend_for(arith)
    if arith == "liger":
        _require("liger_kernel", "the liger backend needs `pip install liger-kernel`")
    with kernel_switches(on, backend), _unservable():
        kernels.reset_fallback_counts()
        logp = kernels.logp(logits.contiguous(), ids, temperature, tp_group=tp_group)
        return logp.float(), kernels.backend_id()


def logp_from_hidden(arith: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, str]:
    """(fp32 log-probs [R], the implementation's id) of ``ids`` under ``hidden [R, H] @ weight.T``."""
    import kernels

    if arith != "kernels-linear":
        raise ValueError(f"{arith}: only kernels-linear reads hidden states")
    with kernel_switches(True), _unservable():
        kernels.reset_fallback_counts()
        logp = kernels.linear_logp(hidden.contiguous(), weight, ids, bias, temperature)
        return logp.float(), kernels.backend_id() + " linear_logp"


def _megatron_logp(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, str]:
    """-CE from megatron-core's vocab-parallel cross-entropy over its initialized TP group."""
    _require("megatron.core", "megatron-core is not installed")
    import importlib.metadata

    from megatron.core import tensor_parallel

    z = logits.float() if temperature == 1.0 else logits.float() / temperature
    # [R, V_local] -> [R, 1, V_local] (Megatron's [s, b, v]); it edits its input in place: a copy.
    logp = -tensor_parallel.vocab_parallel_cross_entropy(z.clone()[:, None, :], ids[:, None])[:, 0]
    return logp.float(), f"megatron-core/{importlib.metadata.version('megatron-core')}"


def _require(module: str, reason: str) -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise SideUnavailable(reason)
