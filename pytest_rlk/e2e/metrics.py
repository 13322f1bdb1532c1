"""The e2e metric schema shared by every engine (vime, TRL): names, units, directions, bands.

An engine delivers, per arm, `ArmSeries`: canonical metric name -> list of floats, one value per
rollout step (index = rollout id, starting at 0). vime's keys are mapped to these names in
`vime_log.VIME_KEY_MAP`; the TRL engine maps its own. Unknown names are carried into reports but
never gated.

Each metric says in which lanes it is compared, how a series is reduced over the window after the
warmup rollouts, and which band applies (with its source, from `pytest_rlk.bands` where one fits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pytest_rlk.bands import DEFAULT_BANDS
from pytest_rlk.schema import Aggregation, Band, Direction, Space

ArmSeries = dict[str, list[float]]
Group = Literal["correctness", "speed", "memory", "fallback", "report"]

# Names of the canonical metrics (use these constants in engines, not string literals).
STEP_TIME = "step_time_s"
ROLLOUT_TIME = "rollout_time_s"
LOG_PROBS_TIME = "log_probs_time_s"
REF_LOG_PROBS_TIME = "ref_log_probs_time_s"
ACTOR_TRAIN_TIME = "actor_train_time_s"
TRAIN_TIME = "train_time_s"
UPDATE_WEIGHTS_TIME = "update_weights_time_s"
TOKENS_PER_GPU_PER_S = "tokens_per_gpu_per_s"
TRAIN_TOKENS_PER_S = "actor_train_tok_per_s"
PEAK_VRAM = "peak_vram_mib"
RAW_REWARD = "raw_reward"
ABS_DIFF = "train_rollout_logprob_abs_diff"
ROLLOUT_KL = "rollout_kl"
KL_LOSS = "kl_loss"
PPO_KL = "ppo_kl"
LOSS = "loss"
PG_LOSS = "pg_loss"
PG_CLIPFRAC = "pg_clipfrac"
GRAD_NORM = "grad_norm"
LOG_PROBS = "log_probs"
ROLLOUT_LOG_PROBS = "rollout_log_probs"
RESPONSE_LENGTH = "response_length"
ENTROPY_LOSS = "entropy_loss"
FALLBACK_COUNT = "fallback_count"
# Recorded by the TRL engine (reported with their units, never gated).
PEAK_RSS = "peak_rss_mib"  # CPU arms: the process's peak resident set (no VRAM to measure)
LOSS_TIME = "loss_time_s"
LOSS_FWD_BWD_TIME = "loss_fwd_bwd_time_s"  # the training forward, the loss and the backward of one step
OPTIMIZER_TIME = "optimizer_time_s"
ENTROPY = "entropy"

# The rest of the mismatch table (pytest_rlk.mismatch.metrics.METRICS: formulas and the peers that
# read them) beside vime's abs_diff, recorded per step where an engine has both log-probs; reported.
MISMATCH_REPORTED: tuple[str, ...] = ("logp_abs_mean", "logp_abs_max", "token_mult_prob_error", "prob_abs_mean",
                                      "kl_k3", "is_weight_mean", "is_ess", "is_capped_2", "is_capped_5")

# Entropy is recorded for the report, never compared across arms: on the fork's linear-logp path
# vime's kernel arm does not materialize it (train/entropy_loss reads 0 there; vime-facts.md,
# "Kernel switches"; the custom-loss adapter does compute it, as vime does), and in the
# TRL lane it is a by-product of the log-prob path under test, not a training outcome.
NEVER_COMPARED: frozenset[str] = frozenset({ENTROPY_LOSS, ENTROPY})

# The per-module times plotted as the step-time breakdown.
MODULE_TIMES: tuple[str, ...] = (
    ROLLOUT_TIME,
    LOG_PROBS_TIME,
    REF_LOG_PROBS_TIME,
    ACTOR_TRAIN_TIME,
    UPDATE_WEIGHTS_TIME,
)

REPLAY_LOSS_BAND = Band(
    rel=0.01,
    abs_floor=1e-3,
    source="rel: Megatron GRPO tests (loss rtol 1%); abs_floor 1e-3: rlk, GRPO losses sit near 0 "
    "where a relative band alone is empty",
)
GRAD_NORM_BAND = Band(rel=0.01, abs_floor=0.01, source="vime in-job CI: grad norm rel/abs 0.01 vs a golden file")
REPLAY_LOGPROB_BAND = Band(
    abs_floor=0.02, source="miles: logprob diff abs 0.02 (same samples replayed, so no relative part)"
)
FALLBACK_BAND = Band(source="ours: the kernel arm must not fall back (count exactly 0)")


@dataclass(frozen=True)
class MetricPolicy:
    """How one canonical metric is compared between the arms."""

    name: str
    unit: str
    direction: Direction
    space: Space
    group: Group
    agg: Aggregation
    band: Band | None
    live: bool  # compared (window-aggregated) in the live A/B lane
    replay_per_step: bool  # compared step by step in the record/replay lane

    @property
    def gated(self) -> bool:
        return self.band is not None


def _policy(
    name: str,
    unit: str,
    direction: Direction,
    space: Space,
    group: Group,
    agg: Aggregation,
    band: Band | None,
    *,
    live: bool = False,
    replay: bool = False,
) -> MetricPolicy:
    return MetricPolicy(name, unit, direction, space, group, agg, band, live, replay)


E2E_METRICS: dict[str, MetricPolicy] = {
    p.name: p
    for p in (
        _policy(STEP_TIME, "s", "lower_is_better", "time", "speed", "median", DEFAULT_BANDS["time"], live=True),
        _policy(TOKENS_PER_GPU_PER_S, "tok/s", "higher_is_better", "throughput", "speed", "median",
                DEFAULT_BANDS["time"], live=True),
        _policy(PEAK_VRAM, "MiB", "lower_is_better", "memory", "memory", "max", DEFAULT_BANDS["memory"], live=True),
        _policy(RAW_REWARD, "", "higher_is_better", "reward", "correctness", "mean", DEFAULT_BANDS["reward"],
                live=True),
        _policy(ABS_DIFF, "", "lower_is_better", "logprob", "correctness", "mean", DEFAULT_BANDS["logprob_diff"],
                live=True),
        _policy(ROLLOUT_KL, "", "lower_is_better", "logprob", "correctness", "mean",
                DEFAULT_BANDS["logprob_diff"], live=True),
        _policy(KL_LOSS, "", "lower_is_better", "logprob", "correctness", "mean", DEFAULT_BANDS["logprob_diff"],
                live=True, replay=True),
        _policy(LOSS, "", "two_sided", "loss", "correctness", "mean", REPLAY_LOSS_BAND, replay=True),
        _policy(PG_LOSS, "", "two_sided", "loss", "correctness", "mean", REPLAY_LOSS_BAND, replay=True),
        _policy(GRAD_NORM, "", "two_sided", "none", "correctness", "mean", GRAD_NORM_BAND, replay=True),
        _policy(LOG_PROBS, "", "two_sided", "logprob", "correctness", "mean", REPLAY_LOGPROB_BAND, replay=True),
        _policy(PPO_KL, "", "two_sided", "logprob", "report", "mean", None),
        _policy(PG_CLIPFRAC, "", "two_sided", "ratio", "report", "mean", None),
        _policy(ROLLOUT_LOG_PROBS, "", "two_sided", "logprob", "report", "mean", None),
        _policy(RESPONSE_LENGTH, "tok", "two_sided", "none", "report", "mean", None),
        _policy(ENTROPY_LOSS, "", "two_sided", "none", "report", "mean", None),
        _policy(ENTROPY, "nat/token", "two_sided", "none", "report", "mean", None),
        _policy(ROLLOUT_TIME, "s", "lower_is_better", "time", "report", "median", None),
        _policy(LOG_PROBS_TIME, "s", "lower_is_better", "time", "report", "median", None),
        _policy(REF_LOG_PROBS_TIME, "s", "lower_is_better", "time", "report", "median", None),
        _policy(ACTOR_TRAIN_TIME, "s", "lower_is_better", "time", "report", "median", None),
        _policy(TRAIN_TIME, "s", "lower_is_better", "time", "report", "median", None),
        _policy(UPDATE_WEIGHTS_TIME, "s", "lower_is_better", "time", "report", "median", None),
        _policy(LOSS_TIME, "s", "lower_is_better", "time", "report", "median", None),
        _policy(LOSS_FWD_BWD_TIME, "s", "lower_is_better", "time", "report", "median", None),
        _policy(OPTIMIZER_TIME, "s", "lower_is_better", "time", "report", "median", None),
        _policy(PEAK_RSS, "MiB", "lower_is_better", "memory", "report", "max", None),
        _policy(TRAIN_TOKENS_PER_S, "tok/s", "higher_is_better", "throughput", "report", "median", None),
        _policy(FALLBACK_COUNT, "", "lower_is_better", "count", "fallback", "max", FALLBACK_BAND),
        *(_policy(name, "", "two_sided" if name.startswith("is_") and not name.startswith("is_capped") else
                  "lower_is_better", "ratio" if name.startswith("is_") or name == "token_mult_prob_error" else "logprob",
                  "report", "mean", None) for name in MISMATCH_REPORTED),
    )
}
