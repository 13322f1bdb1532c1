"""fp32 reference of the ``ratio_kl`` op: ratio and KL from per-token log-probs.

``ratio = exp(logp - old_logp)``; ``kl = compute_kl(logp, ref_logp, kl_type, use_unbiased_kl)``;
both multiplied by ``mask`` (masked tokens give 0 and zero gradient).
"""

from __future__ import annotations

import torch

from kernels import validation
from kernels.reference.kl import check_kl_type, compute_kl


def check_ratio_kl_inputs(
    logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor
) -> None:
    validation.check_tensor(logp, "logp")
    shape = logp.shape
    if len(shape) != 1:
        raise ValueError(f"logp must be 1-D [T], got shape {tuple(shape)}")
    if logp.dtype != torch.float32:
        raise ValueError(f"logp must be float32, got {logp.dtype}")
    num_tokens, device = shape[0], logp.device
    if num_tokens == 0:
        raise ValueError("logp is empty (T == 0)")
    validation.check_token_vector(old_logp, "old_logp", num_tokens, device)
    validation.check_token_vector(ref_logp, "ref_logp", num_tokens, device)
    validation.check_mask(mask, "mask", num_tokens, device)


def ratio_kl(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_type: str = "low_var_kl",
    use_unbiased_kl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logp, old_logp, ref_logp: [T] fp32; mask: [T] bool|float. Returns (ratio [T], kl [T])."""
    check_kl_type(kl_type)
    check_ratio_kl_inputs(logp, old_logp, ref_logp, mask)
    m = mask.float()
    ratio = torch.exp(logp - old_logp.float()) * m
    kl = compute_kl(logp, ref_logp, kl_type, old_logp=old_logp, use_unbiased_kl=use_unbiased_kl) * m
    return ratio, kl
