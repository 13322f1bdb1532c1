"""The compiled variant of the op benchmarks: the public call under ``torch.compile(fullgraph=True)``
(the ops as ``torch.ops.rlk.*``, kernels/library/), the kernels on. A labelled variant recorded
beside the plain call (``impl=compiled_ops``): never the headline, never gated (rlk_bench.measure
gates names starting with ``rlk`` only)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from rlk_bench import measure

COMPILED = "compiled_ops"
KERNELS_ON = {"VIME_RL_KERNEL": "1", "VIME_RL_KERNEL_STRICT": "1"}


def measure_compiled(rlk_metrics, op_fn: Callable[..., Any], run: Callable[[Callable[..., Any]], object],
                     bytes_moved: int, tags: dict[str, object], *, impl: str = COMPILED, **kwargs: Any) -> float:
    """Time ``run(torch.compile(op_fn, fullgraph=True))`` with the kernels on (strict: a fallback
    raises rather than time the reference), recorded as ``impl``; returns the median ms."""
    # one op's public function is compiled by every case of a benchmark (dtypes, shapes, grad or
    # not): each case starts from an empty compile cache, or dynamo's recompile limit (8 per code
    # object) fails the ninth case of a run
    torch.compiler.reset()
    compiled = torch.compile(op_fn, fullgraph=True)
    with mock.patch.dict(os.environ, KERNELS_ON):
        return measure(rlk_metrics, impl, lambda: run(compiled), bytes_moved,
                       {**tags, "variant": "torch.compile(fullgraph) of the public call"}, **kwargs)


__all__ = ["COMPILED", "measure_compiled"]
