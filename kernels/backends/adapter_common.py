"""Helpers shared by the third-party adapters (``liger.py``, ``rl_engine.py``).

An adapter maps our op contract (kernels/contracts/) onto another library's functions only where
the math is vime's. Every rule that says "not the same math" is written once, as a function that
returns the reason (a string) or ``None``; ``supports()`` returns that reason (the case is skipped
or falls back), and the implementation raises ``ValueError`` with the same reason when it is
called anyway, so no call ever runs with silently different math.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels import settings
from kernels.contracts import LossConfig

# LossConfig features and the fields that switch them on, in the order the reasons are checked.
LOSS_FEATURES: dict[str, Callable[[LossConfig], bool]] = {
    "gspo": lambda c: c.gspo,
    "dual_clip": lambda c: c.eps_clip_c is not None,
    "tis": lambda c: c.use_tis,
    "unbiased_kl": lambda c: c.use_unbiased_kl,
}


def unsupported_loss_features(config: LossConfig, reasons: dict[str, str]) -> str | None:
    """The first reason in ``reasons`` (feature name -> why not) whose feature ``config`` uses."""
    for feature, reason in reasons.items():
        if feature not in LOSS_FEATURES:
            raise KeyError(f"unknown LossConfig feature {feature!r}; known: {sorted(LOSS_FEATURES)}")
        if LOSS_FEATURES[feature](config):
            return reason
    return None


def triton_cpu_reason(library: str, device: Any, jit_kernel: Any) -> str | None:
    """Why a Triton kernel of ``library`` cannot run on ``device`` here, or None.

    On CPU tensors a Triton kernel runs only through the interpreter, and ``triton.jit`` decides
    compiled-or-interpreted when the kernel's module is imported (``TRITON_INTERPRET=1`` must be
    set before that import). ``jit_kernel`` is one of the library's ``@triton.jit`` functions: its
    type says which mode this process got."""
    if device is None or torch.device(device).type != "cpu":
        return None
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(jit_kernel, InterpretedFunction):
        return None
    if settings.TRITON_INTERPRET.get() == "1":
        return f"{library}'s kernels were imported before TRITON_INTERPRET=1 was set (CPU tensors need the interpreter)"
    return f"{library}'s Triton kernels need CUDA, or TRITON_INTERPRET=1 set before import for CPU tensors"


def require(reason: str | None, backend_id: str, op: str) -> None:
    """Raise ``ValueError`` naming the backend and op when ``reason`` is not None."""
    if reason is not None:
        raise ValueError(f"{backend_id} backend cannot run {op} for these inputs: {reason}")


def check_ids_in_vocab(target_ids: torch.Tensor, vocab: int, backend_id: str, op: str) -> None:
    """Reject ids outside [0, vocab) (ignore_index included) for kernels that would read them."""
    bad = (target_ids < 0) | (target_ids >= vocab)
    if bool(bad.any()):
        require(
            f"target_ids has {int(bad.sum())} id(s) outside [0, {vocab}) (ignore_index rows are not "
            f"supported by this kernel; it would index the logits with them)",
            backend_id,
            op,
        )
