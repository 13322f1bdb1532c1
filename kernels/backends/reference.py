"""The ``reference`` backend: vime's fp32 math in PyTorch (kernels.reference), every op."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernels.backends.base import OPS, BaseBackend, Capabilities, import_function

REFERENCE_VERSION = "0.1.0"
# op -> module and function of one checked call (imported on first use)
IMPLEMENTATIONS = {
    "logp": ("kernels.reference.logprob", "logp_call"),
    "ratio_kl": ("kernels.reference.ratio_kl", "ratio_kl_call"),
    "grpo_loss": ("kernels.reference.grpo_loss", "grpo_loss_call"),
    "linear_logp": ("kernels.reference.linear_logp", "linear_logp_call"),
}


class ReferenceBackend(BaseBackend):
    id = "reference"
    version = REFERENCE_VERSION
    capabilities = Capabilities(ops=frozenset(OPS))

    def get(self, op: str) -> Callable[..., Any]:
        if op not in IMPLEMENTATIONS:
            raise KeyError(f"unknown op {op!r}; known: {OPS}")
        return import_function(*IMPLEMENTATIONS[op])


def make_backend() -> ReferenceBackend:
    return ReferenceBackend()
