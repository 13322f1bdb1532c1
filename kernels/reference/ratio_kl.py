"""fp32 reference of the ``ratio_kl`` op (kernels/contracts/ratio_kl.py): ratio and KL from log-probs.

``ratio = exp(logp - old_logp)``; ``kl = compute_kl(logp, ref_logp, kl_type, use_unbiased_kl)``;
both multiplied by ``mask`` (masked tokens give 0 and zero gradient).
"""

from __future__ import annotations

import torch

from kernels.contracts import RatioKLCall, entry_point
from kernels.reference.kl import compute_kl


def ratio_kl_call(call: RatioKLCall) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference: (ratio [T], kl [T])."""
    m = call.mask.float()
    ratio = torch.exp(call.logp - call.old_logp.float()) * m
    kl = compute_kl(call.logp, call.ref_logp, call.kl_type, old_logp=call.old_logp,
                    use_unbiased_kl=call.use_unbiased_kl) * m
    return ratio, kl


ratio_kl = entry_point(RatioKLCall, ratio_kl_call, name="ratio_kl")
