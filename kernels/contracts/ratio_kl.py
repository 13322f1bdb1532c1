"""The ``ratio_kl`` op's contract: the PPO ratio and vime's KL estimate from per-token log-probs."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from kernels.contracts.call import tensor_case
from kernels.contracts.checks import check_kl_type, check_mask, check_tensor, check_token_vector


@dataclass(slots=True, eq=False)
class RatioKLCall:
    """``ratio = exp(logp - old_logp) * mask``; ``kl = compute_kl(logp, ref_logp, kl_type, use_unbiased_kl) * mask``
    (kernels/reference/kl.py): masked tokens give 0 and zero gradient.

    logp, old_logp, ref_logp   [T] float32 (``logp`` exactly float32; the others floating point).
    mask                       [T] bool or floating point (0/1 weights).
    kl_type                    ``k1`` | ``k2`` | ``k3`` | ``low_var_kl``.
    use_unbiased_kl            multiply the KL by ``exp(logp - old_logp)``.
    returns                    (ratio fp32 [T], kl fp32 [T]), autograd to ``logp``.
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    mask: torch.Tensor
    _: KW_ONLY
    kl_type: str = "low_var_kl"
    use_unbiased_kl: bool = False

    def __post_init__(self) -> None:
        check_kl_type(self.kl_type)
        check_ratio_kl_inputs(self.logp, self.old_logp, self.ref_logp, self.mask)
        self.use_unbiased_kl = bool(self.use_unbiased_kl)

    def case(self) -> dict[str, Any]:
        return {**tensor_case(self.logp), "kl_type": self.kl_type, "use_unbiased_kl": self.use_unbiased_kl}


def check_ratio_kl_inputs(
    logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor
) -> None:
    check_tensor(logp, "logp")
    shape = logp.shape
    if len(shape) != 1:
        raise ValueError(f"logp must be 1-D [T], got shape {tuple(shape)}")
    if logp.dtype != torch.float32:
        raise ValueError(f"logp must be float32, got {logp.dtype}")
    num_tokens, device = shape[0], logp.device
    if num_tokens == 0:
        raise ValueError("logp is empty (T == 0)")
    check_token_vector(old_logp, "old_logp", num_tokens, device)
    check_token_vector(ref_logp, "ref_logp", num_tokens, device)
    check_mask(mask, "mask", num_tokens, device)


__all__ = ["RatioKLCall", "check_ratio_kl_inputs"]
