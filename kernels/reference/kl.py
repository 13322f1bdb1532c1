"""fp32 reference of vime's approximate KL between the policy and the reference model.

With ``r = logp - ref_logp`` (per token, fp32):
``k1 = r``; ``k2 = r**2 / 2``; ``k3 = exp(-r) - 1 + r``; ``low_var_kl = clamp(k3, -10, 10)``.
``use_unbiased_kl`` multiplies the result by ``exp(logp - old_logp)`` (after the clamp; the
factor is not detached, so it carries gradient to ``logp``).
"""

from __future__ import annotations

import torch

from kernels.contracts.checks import KL_TYPES, check_kl_type

__all__ = ["KL_TYPES", "compute_kl"]


def compute_kl(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kl_type: str = "low_var_kl",
    *,
    old_logp: torch.Tensor | None = None,
    use_unbiased_kl: bool = False,
) -> torch.Tensor:
    """Per-token KL estimate. logp, ref_logp (and old_logp when ``use_unbiased_kl``): [T] fp32.

    Returns fp32 [T]."""
    check_kl_type(kl_type)
    r = logp.float() - ref_logp.float()
    if kl_type == "k1":
        kl = r
    elif kl_type == "k2":
        kl = r * r / 2.0
    else:
        kl = torch.exp(-r) - 1.0 + r
        if kl_type == "low_var_kl":
            kl = kl.clamp(min=-10.0, max=10.0)
    if use_unbiased_kl:
        if old_logp is None:
            raise ValueError("use_unbiased_kl=True needs old_logp")
        kl = kl * torch.exp(logp.float() - old_logp.float())
    return kl
