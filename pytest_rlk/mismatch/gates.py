"""Default bands of the mismatch metrics, vime's absolute ceiling, and the per-step check.

Each band is an absolute range a healthy run's metric stays in, stated once here with the peer it
comes from. They are alarms for a whole train/rollout pair (an A/B lane, a drift comparison against
the rollout engine), beside any regression band against a baseline; the metrics without a band
(``logp_abs_max``, the cap shares) are measured and recorded.

``every_step_within`` is the lr=0 lane's gate (prime-rl's bar: the mismatch KL on every step of a
20-step run with the learning rate at 0): every step within every band, not only the mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pytest_rlk.mismatch.metrics import BY_NAME, METRICS, MismatchError, MismatchMetrics

VIME_ABS_DIFF_CEILING = 0.1
VIME_ABS_DIFF_CEILING_SOURCE = ("vime PR 94 (a backport of slime PR 1968): `train_rollout_logprob_abs_diff <= 0.1` "
                                "under --ci-test, the default of --ci-train-rollout-logprob-abs-diff-threshold")


@dataclass(frozen=True)
class MetricBand:
    metric: str
    low: float | None  # None: unbounded below
    high: float | None  # None: unbounded above
    source: str

    def __post_init__(self) -> None:
        if self.metric not in BY_NAME:
            raise MismatchError(f"band for {self.metric!r}: not a mismatch metric; metrics: {', '.join(BY_NAME)}")
        if self.low is None and self.high is None:
            raise MismatchError(f"band for {self.metric}: neither a low nor a high bound")

    def describe(self) -> str:
        if self.low is None:
            return f"{self.metric} <= {self.high:g}"
        if self.high is None:
            return f"{self.metric} >= {self.low:g}"
        return f"{self.low:g} <= {self.metric} <= {self.high:g}"

    def problem(self, value: float) -> str | None:
        """Why ``value`` is outside the band (a non-finite value always is), or None."""
        ok = math.isfinite(value) and (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        return None if ok else f"{self.metric} {value:.4g} outside {self.describe()} ({self.source})"


DEFAULT_BANDS: tuple[MetricBand, ...] = (
    MetricBand("train_rollout_logprob_abs_diff", None, VIME_ABS_DIFF_CEILING, VIME_ABS_DIFF_CEILING_SOURCE),
    MetricBand("token_mult_prob_error", None, 1.1, "NeMo-RL nightly: median(token_mult_prob_error) < 1.1"),
    MetricBand("prob_abs_mean", None, 0.01, "verl docs: rollout_probs_diff < 0.005 normal, > 0.01 a bug"),
    MetricBand("kl_k3", None, 0.015, "prime-rl new-model bar: mismatch KL < 0.015 on every step (lr 0)"),
    MetricBand("is_weight_mean", 0.5, 2.0, "verl rollout correction: mean IS weight in [0.5, 2]"),
    MetricBand("is_ess", 0.3, None, "verl rollout correction: ESS >= 0.3"),
)
VIME_CEILING_ONLY: tuple[MetricBand, ...] = DEFAULT_BANDS[:1]


def vime_ceiling(metric: str = "train_rollout_logprob_abs_diff") -> MetricBand:
    """vime's ceiling as a band on ``metric``: its own sample-mean abs_diff by default; a lane whose
    stack logs the token mean instead (TRL's ``sampling/sampling_logp_difference/mean``, here
    ``logp_abs_mean``) holds that to the same number."""
    if metric == "train_rollout_logprob_abs_diff":
        return DEFAULT_BANDS[0]
    return MetricBand(metric, None, VIME_ABS_DIFF_CEILING, f"{VIME_ABS_DIFF_CEILING_SOURCE}, applied to {metric}")


def _values(metrics: MismatchMetrics | Mapping[str, float]) -> Mapping[str, float]:
    return metrics.values() if isinstance(metrics, MismatchMetrics) else metrics


def band_problems(metrics: MismatchMetrics | Mapping[str, float],
                  bands: Sequence[MetricBand] = DEFAULT_BANDS) -> list[str]:
    """Each band that ``metrics`` (a :class:`MismatchMetrics` or {name: value}) leaves, as a message;
    a band whose metric is missing from a mapping is a problem too (never a silent pass)."""
    values = _values(metrics)
    out = []
    for band in bands:
        if band.metric not in values:
            out.append(f"{band.metric}: not given, so {band.describe()} ({band.source}) cannot be checked")
            continue
        problem = band.problem(float(values[band.metric]))
        if problem:
            out.append(problem)
    return out


def every_step_within(steps: Sequence[MismatchMetrics | Mapping[str, float]],
                      bands: Sequence[MetricBand] = DEFAULT_BANDS) -> list[str]:
    """"Every step within the band, not only the mean": a message per (step, band) outside it,
    steps numbered from 0 as given. No steps is an error (a lane that logged nothing passes nothing)."""
    if not steps:
        raise MismatchError("every_step_within: no steps given")
    return [f"step {i}: {p}" for i, step in enumerate(steps) for p in band_problems(step, bands)]


def markdown_table(bands: Sequence[MetricBand] = DEFAULT_BANDS) -> str:
    """The metric table (metrics.METRICS) with each metric's default band, as markdown: docs/drift.md
    holds this table."""
    by_metric = {b.metric: b for b in bands}
    rows = ["| metric | formula (d = train_logp - rollout_logp, w = exp(d); masked means) | used by | default band |",
            "|---|---|---|---|"]
    for m in METRICS:
        band = by_metric.get(m.name)
        rows.append(f"| `{m.name}` | {m.formula} | {m.peers} | "
                    + (f"{band.describe()} ({band.source})" if band else "measured, no band") + " |")
    return "\n".join(rows)
