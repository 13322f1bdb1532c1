"""The ``grpo_loss`` op's contract: vime's GRPO loss from logits, its knobs and its per-token inputs."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kernels import device_errors
from kernels.contracts.call import tensor_case, tp_world
from kernels.contracts.checks import (
    IGNORE_INDEX,
    check_ids_values,
    check_kl_type,
    check_lengths,
    check_lengths_values,
    check_logits,
    check_mask,
    check_target_ids,
    check_temperature,
    check_token_vector,
)

REDUCTIONS = ("sum_of_sample_mean", "per_token_sum")
METRIC_NAMES = ("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss")


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


@dataclass(slots=True, eq=False, kw_only=True)
class LossInputs:
    """The per-token inputs of vime's loss besides the log-probs (all [T] on one device).

    old_logp        [T] floating point: the log-probs the rollout's policy gave (PPO's "old").
    ref_logp        [T] floating point, or None (allowed only when ``config.kl_loss_coef == 0``).
    advantages      [T] floating point, per token.
    loss_mask       [T] bool or floating point (0/1 weights).
    lengths         [B] integer lengths of the packed samples (>= 0, summing to T), or
    cu_seqlens      [B + 1] their offsets (0, ..., T); neither: one sample of all T tokens.
    config          :class:`LossConfig`.
    rollout_logp    [T] floating point: the rollout engine's log-probs (required by ``config.use_tis``).

    Checked against a T and a device by :meth:`check`: a :class:`GrpoLossCall` checks them
    against its logits, ``kernels.reference.grpo_loss_from_logp`` against its log-probs.
    """

    old_logp: torch.Tensor
    ref_logp: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    config: LossConfig = LossConfig()
    rollout_logp: torch.Tensor | None = None

    def check(self, num_tokens: int, device: torch.device) -> bool:
        """Shapes, devices and dtypes of the per-token inputs, then the packing; returns whether the
        packing's values are left to the device (checks.check_lengths)."""
        check_token_vector(self.old_logp, "old_logp", num_tokens, device)
        check_token_vector(self.advantages, "advantages", num_tokens, device)
        check_mask(self.loss_mask, "loss_mask", num_tokens, device)
        if self.ref_logp is None:
            if self.config.kl_loss_coef != 0.0:
                raise ValueError("ref_logp is required when kl_loss_coef != 0")
        else:
            check_token_vector(self.ref_logp, "ref_logp", num_tokens, device)
        if self.config.use_tis:
            if self.rollout_logp is None:
                raise ValueError("rollout_logp is required when LossConfig.use_tis is True")
            check_token_vector(self.rollout_logp, "rollout_logp", num_tokens, device)
        return check_lengths(self.lengths, self.cu_seqlens, num_tokens)

    def check_lengths_values(self, num_tokens: int) -> None:
        """The packing's values on the host (a host sync for device tensors)."""
        check_lengths_values(self.lengths, self.cu_seqlens, num_tokens)

    def sample_lengths(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """The packed samples' [B] int64 lengths on ``device`` (see :func:`sample_lengths`)."""
        return sample_lengths(num_tokens, device, self.lengths, self.cu_seqlens)

    def num_samples(self) -> int:
        if self.lengths is not None:
            return int(self.lengths.shape[0])
        if self.cu_seqlens is not None:
            return int(self.cu_seqlens.shape[0]) - 1
        return 1


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device`` without a host sync: a CPU tensor goes to a CUDA device through pinned
    memory, asynchronously (a copy from pageable memory would wait for the device)."""
    if x.device == device:
        return x
    if x.device.type == "cpu" and device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def sample_lengths(num_tokens: int, device: torch.device, lengths: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """[B] int64 lengths on ``device`` from ``lengths`` [B] or ``cu_seqlens`` [B + 1] (checked by
    checks.check_lengths); neither: one sample of all ``num_tokens``."""
    if lengths is not None:
        return to_device(lengths, device).to(torch.int64)
    if cu_seqlens is not None:
        cu_seqlens = to_device(cu_seqlens, device)
        return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    # a fill on the device: torch.tensor([T], device=...) would copy from pageable memory (a host sync)
    return torch.full((1,), num_tokens, dtype=torch.int64, device=device)


@dataclass(slots=True, eq=False)
class GrpoLossCall(LossInputs):
    """vime's GRPO loss from logits (kernels/reference/grpo_loss.py states the math):

        logp = selected log-prob of logits (see LogpCall); pg, clipfrac, ppo_kl = vime's clipped
        policy loss (GSPO: sequence ratio; TIS weights); kl = compute_kl(logp, ref_logp);
        loss = reduce(pg) + kl_loss_coef * reduce(kl), ``reduce`` = config.reduction over the samples.

    logits            [T, V] float32 | bfloat16 | float16, contiguous along V (with ``tp_group``:
                      [T, V_local], as in LogpCall).
    target_ids        [T] int64 | int32 global ids, or ``ignore_index``.
    (old_logp ... rollout_logp: :class:`LossInputs`, keyword-only.)
    temperature       a finite float > 0.
    tp_group          the process group the vocab is split over, or None.
    deferred          (set by the checks) the call id (kernels/device_errors.py) under which the
                      kernels check the ids and lengths on the device, or 0: checked already.
    inplace_backward  let the backward write dlogits into the logits' storage (no [T, V] allocation;
                      the logits are destroyed, a second backward raises). Implementations that never
                      write their inputs ignore it.
    returns           (loss: 0-dim fp32, autograd to ``logits``; {"pg_loss", "pg_clipfrac", "ppo_kl",
                      "kl_loss"}: detached 0-dim fp32 tensors).
    """

    logits: torch.Tensor
    target_ids: torch.Tensor
    _: KW_ONLY
    temperature: float = 1.0
    tp_group: dist.ProcessGroup | None = None
    inplace_backward: bool = False
    ignore_index: int = IGNORE_INDEX
    num_tokens: int = field(init=False, repr=False)
    tp_world: int = field(init=False, repr=False)
    vocab: int = field(init=False, repr=False)  # this rank's columns
    deferred: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        num_tokens, vocab = check_logits(self.logits)
        temperature = check_temperature(self.temperature)
        world = tp_world(self.tp_group)
        device = self.logits.device
        ids_deferred = check_target_ids(self.target_ids, num_tokens, vocab * world, device, self.ignore_index)
        lengths_deferred = self.check(num_tokens, device)
        self.deferred = device_errors.begin_call("grpo_loss", num_tokens, vocab) if (
            ids_deferred or lengths_deferred) else 0
        self.vocab = vocab
        self.temperature = temperature
        self.ignore_index = int(self.ignore_index)
        self.inplace_backward = bool(self.inplace_backward)
        self.num_tokens = num_tokens
        self.tp_world = world

    def check_values(self) -> None:
        """The value checks left to the device, on the host (checks.check_call_values)."""
        check_ids_values(self.target_ids, self.vocab * self.tp_world, self.ignore_index)
        self.check_lengths_values(self.num_tokens)

    def case(self) -> dict[str, Any]:
        return {**tensor_case(self.logits), "temperature": self.temperature, "tp_world": self.tp_world,
                "config": self.config, "inplace_backward": self.inplace_backward,
                "num_samples": self.num_samples()}


__all__ = ["METRIC_NAMES", "REDUCTIONS", "GrpoLossCall", "LossConfig", "LossInputs", "sample_lengths", "to_device"]
