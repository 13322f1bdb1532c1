"""A test-only kernel backend: the fp32 reference with every log-prob one fp32 ulp off: the control
arm of the training step (suites/module/test_training_step.py).

Two runs that differ only in last bits, as our kernels and the reference do (another summation
order, another exp), drift apart over optimizer steps: AdamW normalizes each update, so a parameter
whose gradient is near zero moves by about the learning rate whichever way its last bits point,
and bf16 weights round those moves. How far a one-ulp difference takes a run of a given model and
batch is what this arm measures; the kernels arm is held to a multiple of it. The log-probs move
up by one ulp at even tokens and down at odd ones (``torch.nextafter``); their gradient is the
reference's. Select it with ``VIME_RL_KERNEL_BACKEND=suites.module.last_bit_backend:make_backend``
(the registry resolves the dotted path). ``WRONG_DOTTED_PATH`` selects the same backend with every
log-prob ``WRONG_BY`` too high instead, ``WRONG_AT_EVEN_DOTTED_PATH`` with those at even positions
``WRONG_BY`` too high: kernels that are wrong, which the training step must reject. Nothing in the
product knows about them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from kernels.backends import get_backend
from kernels.backends.base import BaseBackend

DOTTED_PATH = "suites.module.last_bit_backend:make_backend"
WRONG_DOTTED_PATH = "suites.module.last_bit_backend:make_wrong_backend"
WRONG_AT_EVEN_DOTTED_PATH = "suites.module.last_bit_backend:make_wrong_at_even_backend"
BACKEND_ID = "rlk-test-reference-last-bit"
WRONG_BY = 1e-3  # log-prob units


def _even_positions(t: torch.Tensor) -> torch.Tensor:
    return torch.arange(t.numel(), device=t.device).remainder(2).eq(0).view_as(t)


def one_ulp_apart(logp: torch.Tensor) -> torch.Tensor:
    """``logp`` with each value moved to its fp32 neighbour (up at even positions, down at odd
    ones); the gradient flows as through ``logp``."""
    base = logp.detach()
    toward = torch.where(_even_positions(base), torch.full_like(base, math.inf), torch.full_like(base, -math.inf))
    return logp + (torch.nextafter(base, toward) - base)


class LastBitBackend(BaseBackend):
    """Every op of the ``reference`` backend; ``logp`` through ``move`` (default: one ulp off)."""

    id = BACKEND_ID

    def __init__(self, move: Callable[[torch.Tensor], torch.Tensor] = one_ulp_apart, label: str = "1ulp") -> None:
        self._inner = get_backend("reference")
        self._move = move
        self.version = f"{self._inner.version}+{label}"
        self.capabilities = self._inner.capabilities

    def check_case(self, op: str, **case: Any) -> str | None:
        return self._inner.supports(op, **case)

    def get(self, op: str) -> Callable[..., Any]:
        inner = self._inner.get(op)
        if op != "logp":
            return inner
        return lambda call: self._move(inner(call))


def make_backend() -> LastBitBackend:
    return LastBitBackend()


def make_wrong_backend() -> LastBitBackend:
    return LastBitBackend(lambda logp: logp + WRONG_BY, f"wrong-by-{WRONG_BY:g}")


def make_wrong_at_even_backend() -> LastBitBackend:
    return LastBitBackend(lambda logp: logp + WRONG_BY * _even_positions(logp), f"wrong-by-{WRONG_BY:g}-at-even")
