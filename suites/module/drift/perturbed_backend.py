"""A deliberately wrong kernel backend, to prove the ladder puts a kernel's drift in rung A1.

It is ``rlk-triton`` except that ``logp`` hands back its log-probs rounded to bf16 (an output-dtype
bug a fused kernel can ship with: ~|logp| * 2^-9, a few 1e-3 at logp ~ -2, far above fp32's 1e-5
tolerance). Load it like any third-party backend::

    VIME_RL_KERNEL_BACKEND=suites.module.drift.perturbed_backend:make_backend
    pytest ... --rlk-backend suites.module.drift.perturbed_backend:make_backend
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels.backends.triton import TritonBackend

FACTORY = "suites.module.drift.perturbed_backend:make_backend"


class BF16OutputBackend(TritonBackend):
    id = "rlk-triton-bf16-output"

    def get(self, op: str) -> Callable[..., Any]:
        impl = super().get(op)
        if op != "logp":
            return impl

        def logp_rounded_to_bf16(*args: Any, **kwargs: Any) -> torch.Tensor:
            return impl(*args, **kwargs).to(torch.bfloat16).float()

        return logp_rounded_to_bf16


def make_backend() -> BF16OutputBackend:
    return BF16OutputBackend()
