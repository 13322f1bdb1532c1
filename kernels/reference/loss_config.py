"""``LossConfig``: the knobs of vime's GRPO loss, shared by the reference and every backend."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.reference.kl import check_kl_type
from kernels.reference.reductions import REDUCTIONS


@dataclass(frozen=True)
class LossConfig:
    """vime's policy-loss settings (names follow vime's flags).

    eps_clip / eps_clip_high: lower / upper PPO clip (asymmetric allowed). eps_clip_c: dual clip
    (> 1) or None. kl_loss_coef: weight of the KL term (0 = no KL term; ``kl_loss`` is still
    reported). kl_type: k1|k2|k3|low_var_kl. use_unbiased_kl: multiply KL by exp(logp - old).
    use_tis: multiply pg by clamp(exp(old - rollout), tis_clip_low, tis_clip_high) (needs
    ``rollout_logp``). reduction: sum_of_sample_mean (vime default) | per_token_sum
    (``--calculate-per-token-loss``). gspo: sequence-level ratio.
    """

    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    eps_clip_c: float | None = None
    kl_loss_coef: float = 0.0
    kl_type: str = "low_var_kl"
    use_unbiased_kl: bool = False
    use_tis: bool = False
    tis_clip_low: float = 0.0
    tis_clip_high: float = 2.0
    reduction: str = "sum_of_sample_mean"
    gspo: bool = False

    def __post_init__(self) -> None:
        check_kl_type(self.kl_type)
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"LossConfig.reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.eps_clip < 0 or self.eps_clip_high < 0:
            raise ValueError(f"LossConfig eps_clip/eps_clip_high must be >= 0, got {self.eps_clip}/{self.eps_clip_high}")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError(f"LossConfig.eps_clip_c must be > 1 (dual clip) or None, got {self.eps_clip_c}")
        if self.tis_clip_low > self.tis_clip_high:
            raise ValueError("LossConfig.tis_clip_low must be <= tis_clip_high")
