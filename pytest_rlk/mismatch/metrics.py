"""The mismatch metrics, defined once: what each stack reads off training vs rollout log-probs.

With ``d = train_logp - rollout_logp`` (natural-log probabilities of the sampled tokens) over the
active tokens (mask 1), and the importance weight ``w = exp(d) = pi_train / pi_rollout`` that a
TIS / MIS correction multiplies the loss by (the tokens were sampled from the rollout's policy):

each metric of :data:`METRICS` (the one definition: name, formula, the peer that uses it; the drift
tables and docs/drift.md render from it) is a masked mean of ``|d|``, ``exp(|d|)``, the probability
difference, the k3 term ``w - 1 - d`` or ``w`` itself, the max of ``|d|``, the normalized effective
sample size of ``w``, or the share of tokens above a cap of 2 or 5.

A cap C's share is what truncated IS (TIS) clips to C and what token-level masked IS (MIS) drops.
:func:`mismatch_metrics` computes every metric at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

IS_CAPS = (2.0, 5.0)


class MismatchError(ValueError):
    """Inputs the metrics cannot be computed from (the message names the bad input)."""


@dataclass(frozen=True)
class MetricDef:
    name: str
    formula: str
    peers: str
    space: str  # what the value is: "logprob", "ratio" (a probability ratio), "prob", "share"
    direction: str  # "lower_is_better" | "two_sided" (for a regression gate)


METRICS: tuple[MetricDef, ...] = (
    MetricDef("train_rollout_logprob_abs_diff", "mean over samples of each sample's mean abs(d)",
              "vime, slime (`train/train_rollout_logprob_abs_diff`)", "logprob", "lower_is_better"),
    MetricDef("logp_abs_mean", "mean abs(d)", "vime, slime", "logprob", "lower_is_better"),
    MetricDef("logp_abs_max", "max abs(d)", "vime (RL-Kernel strict gate), slime", "logprob", "lower_is_better"),
    MetricDef("token_mult_prob_error", "mean exp(abs(d))", "NeMo-RL (`token_mult_prob_error`)", "ratio",
              "lower_is_better"),
    MetricDef("prob_abs_mean", "mean abs(exp(train_logp) - exp(rollout_logp))", "verl (`rollout_probs_diff`)", "prob",
              "lower_is_better"),
    MetricDef("kl_k3", "mean (w - 1 - d): k3 estimate of KL(rollout, train)", "slime, miles; prime-rl (mismatch KL)",
              "logprob", "lower_is_better"),
    MetricDef("is_weight_mean", "mean w", "verl (TIS / MIS)", "ratio", "two_sided"),
    MetricDef("is_ess", "(sum w)^2 / (N sum w^2)", "verl (TIS / MIS)", "ratio", "two_sided"),
    MetricDef("is_capped_2", "share of tokens with w > 2 (TIS clips them, MIS masks them)",
              "vime / slime TIS (`--tis-clip 2`)", "share", "lower_is_better"),
    MetricDef("is_capped_5", "share of tokens with w > 5", "a looser TIS / MIS cap", "share", "lower_is_better"),
)
METRIC_NAMES = tuple(m.name for m in METRICS)
# the names stacks log these metrics under (read from their code: vime's metric keys, TRL 1.16's
# GRPOTrainer, which logs the token mean and max of |old - sampling| log-probs with vLLM's importance
# sampling correction on; its logged importance_sampling_ratio is the corrected one, after the cap or
# mask, so it is not w)
LOGGED_AS = {
    "train/train_rollout_logprob_abs_diff": "train_rollout_logprob_abs_diff",
    "sampling/sampling_logp_difference/mean": "logp_abs_mean",
    "sampling/sampling_logp_difference/max": "logp_abs_max",
}
BY_NAME = {m.name: m for m in METRICS}


@dataclass(frozen=True)
class MismatchMetrics:
    """Every metric of :data:`METRICS` for one set of tokens, and the active-token count."""

    train_rollout_logprob_abs_diff: float
    logp_abs_mean: float
    logp_abs_max: float
    token_mult_prob_error: float
    prob_abs_mean: float
    kl_k3: float
    is_weight_mean: float
    is_ess: float
    is_capped_2: float
    is_capped_5: float
    active_tokens: int
    samples: int

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def values(self) -> dict[str, float]:
        """{metric name: value} for the metrics of :data:`METRICS`, in the table's order."""
        return {name: getattr(self, name) for name in METRIC_NAMES}


def _flat(name: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise MismatchError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (1, 2):
        raise MismatchError(f"{name}: shape {tuple(x.shape)}; expected [tokens] or [samples, tokens]")
    return x


def _sample_index(shape: torch.Size, lengths: Sequence[int] | torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if len(shape) == 2:
        if lengths is not None:
            raise MismatchError("lengths: give them for flat [tokens] inputs only (a [samples, tokens] input's rows "
                                "are its samples)")
        return torch.arange(shape[0], device=device).repeat_interleave(shape[1])
    n = shape[0]
    if lengths is None:
        return torch.zeros(n, dtype=torch.long, device=device)
    lens = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
    if (lens < 0).any() or int(lens.sum()) != n:
        raise MismatchError(f"lengths {lens.tolist()}: must be >= 0 and sum to the {n} tokens given")
    return torch.arange(lens.numel()).repeat_interleave(lens).to(device)


def mismatch_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None = None, *,
                     lengths: Sequence[int] | torch.Tensor | None = None) -> MismatchMetrics:
    """Every metric of :data:`METRICS` for ``train_logp`` against ``rollout_logp``.

    ``train_logp``, ``rollout_logp`` and ``mask`` are [tokens] (samples concatenated; ``lengths``
    gives each sample's token count, default one sample) or [samples, tokens] (a row per sample).
    ``mask`` holds 0 / 1 (bool or numbers; default all 1); means are over its active tokens, and
    ``train_rollout_logprob_abs_diff`` averages each sample's own mean over the samples with an active
    token (vime's sum_of_sample_mean divided by the sample count). Computed in float64."""
    train_logp, rollout_logp = _flat("train_logp", train_logp), _flat("rollout_logp", rollout_logp)
    if train_logp.shape != rollout_logp.shape:
        raise MismatchError(f"train_logp shape {tuple(train_logp.shape)} != rollout_logp shape {tuple(rollout_logp.shape)}")
    if train_logp.device != rollout_logp.device:
        raise MismatchError(f"train_logp on {train_logp.device}, rollout_logp on {rollout_logp.device}")
    for name, x in (("train_logp", train_logp), ("rollout_logp", rollout_logp)):
        if not x.is_floating_point():
            raise MismatchError(f"{name}: dtype {x.dtype}; expected floating-point log-probs")
    if mask is None:
        mask = torch.ones_like(train_logp, dtype=torch.bool)
    mask = _flat("mask", mask)
    if mask.shape != train_logp.shape:
        raise MismatchError(f"mask shape {tuple(mask.shape)} != the log-probs' {tuple(train_logp.shape)}")
    m = mask.to(device=train_logp.device, dtype=torch.float64)
    if not bool(((m == 0) | (m == 1)).all()):
        raise MismatchError(f"mask: values {sorted(set(m.unique().tolist()))[:6]}; expected 0 / 1")
    sample = _sample_index(train_logp.shape, lengths, train_logp.device)
    active = (m == 1).reshape(-1)
    if not bool(active.any()):
        raise MismatchError("mask: no active token")
    a = train_logp.detach().reshape(-1).double()[active]
    b = rollout_logp.detach().reshape(-1).double()[active]
    for name, x in (("train_logp", a), ("rollout_logp", b)):
        bad = torch.nonzero(~torch.isfinite(x)).reshape(-1)
        if bad.numel():
            pos = int(torch.nonzero(active).reshape(-1)[int(bad[0])])
            raise MismatchError(f"{name}: {x[int(bad[0])].item()} at flat token {pos} is not finite "
                                f"({bad.numel()} such active tokens)")
    d = a - b
    absd = d.abs()
    w = torch.exp(d)
    n = absd.numel()
    s = sample[active]
    n_samples = int(s.max()) + 1
    per_sum = torch.zeros(n_samples, dtype=torch.float64, device=d.device).index_add_(0, s, absd)
    per_cnt = torch.zeros(n_samples, dtype=torch.float64, device=d.device).index_add_(0, s, torch.ones_like(absd))
    has = per_cnt > 0
    return MismatchMetrics(
        train_rollout_logprob_abs_diff=float((per_sum[has] / per_cnt[has]).mean()),
        logp_abs_mean=float(absd.mean()), logp_abs_max=float(absd.max()),
        token_mult_prob_error=float(torch.exp(absd).mean()),
        prob_abs_mean=float((torch.exp(a) - torch.exp(b)).abs().mean()),
        kl_k3=float((torch.expm1(d) - d).mean()),
        is_weight_mean=float(w.mean()), is_ess=float(w.sum() ** 2 / (n * (w * w).sum())),
        is_capped_2=float((w > IS_CAPS[0]).double().mean()), is_capped_5=float((w > IS_CAPS[1]).double().mean()),
        active_tokens=n, samples=int(has.sum()))


def from_logged(logged: Mapping[str, float]) -> dict[str, float]:
    """The mismatch metrics a stack's logged step holds, under this table's names (:data:`LOGGED_AS`;
    keys this table already uses pass through)."""
    out = {}
    for key, value in logged.items():
        name = LOGGED_AS.get(key, key if key in BY_NAME else None)
        if name is not None:
            out[name] = float(value)
    return out
