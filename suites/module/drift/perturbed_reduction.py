"""A deliberately batch-variant reduction, to prove the ladder puts a changed reduction order in rung A2.

Qwen3's RMSNorm with its sum of squares reduced in another order whenever a forward holds more than
one sequence: four partial sums, each rounded to bf16, then added (a split reduction that a kernel
picks by batch size, with low-precision partials: ~2^-9 relative on the variance, 1e-4..1e-3 on the
log-probs, far above the fp32 batch-invariance bound of 1e-5). A forward of one sequence (the
``alone`` and ``packed`` layouts) reduces as transformers does. Every comparison whose two sides
forward the same batch shapes sees the same reduction on both sides. On a GPU, where forwards of
other batch shapes (``micro2``) already differ at ~1e-6, the bf16 rounding of the partials turns
that into ~1e-4: a layout effect too, in A2.

    with batch_variant_rmsnorm():
        run_ladder(...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PARTS = 4


def _batch_variant_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    if x.dim() >= 3 and x.shape[0] > 1 and x.shape[-1] % PARTS == 0:
        partials = x.pow(2).reshape(*x.shape[:-1], PARTS, -1).sum(-1).to(torch.bfloat16).float()
        variance = partials.sum(-1, keepdim=True) / x.shape[-1]
    else:
        variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * x.to(input_dtype)


@contextlib.contextmanager
def batch_variant_rmsnorm() -> Iterator[None]:
    """Qwen3's and Qwen3-MoE's RMSNorm batch-variant while the block runs (this process only)."""
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    classes = (modeling_qwen3.Qwen3RMSNorm, modeling_qwen3_moe.Qwen3MoeRMSNorm)
    saved = [cls.forward for cls in classes]
    try:
        for cls in classes:
            cls.forward = _batch_variant_forward
        yield
    finally:
        for cls, forward in zip(classes, saved):
            cls.forward = forward
