"""The ``reference`` backend: vime's fp32 math in PyTorch (kernels.reference). Supports everything
except ``linear_logp`` (its reference is registered by the linear_logp module when present)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kernels.backends.base import OPS, BaseBackend, Capabilities

REFERENCE_VERSION = "0.1.0"


class ReferenceBackend(BaseBackend):
    id = "reference"
    version = REFERENCE_VERSION
    capabilities = Capabilities(ops=frozenset({"logp", "ratio_kl", "grpo_loss", "linear_logp"}))

    def get(self, op: str) -> Callable[..., Any]:
        if op not in OPS:
            raise KeyError(f"unknown op {op!r}; known: {OPS}")
        if op == "logp":
            from kernels.reference.logprob import selected_logprob, vocab_parallel_selected_logprob

            def reference_logp(logits, target_ids, temperature=1.0, *, tp_group=None, ignore_index=-100):
                if tp_group is None:
                    return selected_logprob(logits, target_ids, temperature, ignore_index=ignore_index)
                return vocab_parallel_selected_logprob(
                    logits, target_ids, temperature, tp_group, ignore_index=ignore_index
                )

            return reference_logp
        if op == "linear_logp":
            # owned by the linear_logp engineer: kernels/reference/linear_logp.py
            return importlib.import_module("kernels.reference.linear_logp").linear_logp
        module = importlib.import_module(f"kernels.reference.{op}")
        return getattr(module, op)


def make_backend() -> ReferenceBackend:
    return ReferenceBackend()
