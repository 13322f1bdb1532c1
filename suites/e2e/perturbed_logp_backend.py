"""A test-only kernel backend: ``rlk-triton`` with every log-prob of the ``logp`` op off by ``LOGP_BIAS``.

It exists to prove that the A/B gate can fail: ``suites/e2e/test_trl_ab.py`` runs a third, perturbed
kernel arm with ``VIME_RL_KERNEL_BACKEND=suites.e2e.perturbed_logp_backend:make_backend`` (the
backend registry resolves the dotted path; the arm's ``PYTHONPATH`` leads with the checkout, where
``suites`` is importable). Nothing in the product knows about it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernels.backends import get_backend
from kernels.backends.base import BaseBackend, Capabilities

DOTTED_PATH = "suites.e2e.perturbed_logp_backend:make_backend"
BACKEND_ID = "rlk-test-perturbed-logp"
LOGP_BIAS = 0.1  # log-prob units; the A/B logprob-diff band is abs 0.02


class PerturbedLogpBackend(BaseBackend):
    """Serves ``logp`` only, as ``rlk-triton`` does, plus ``LOGP_BIAS``."""

    id = BACKEND_ID

    def __init__(self) -> None:
        self._inner = get_backend("rlk-triton")
        self.version = f"{self._inner.version}+bias{LOGP_BIAS:g}"
        self.capabilities = Capabilities(ops=frozenset({"logp"}))

    def check_case(self, op: str, **case: Any) -> str | None:
        return self._inner.supports(op, **case)

    def get(self, op: str) -> Callable[..., Any]:
        if op != "logp":
            raise KeyError(f"{self.id} serves logp only, not {op!r}")
        inner = self._inner.get(op)
        return lambda call: inner(call) + LOGP_BIAS


def make_backend() -> PerturbedLogpBackend:
    return PerturbedLogpBackend()
