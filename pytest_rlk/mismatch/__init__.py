"""Train/rollout mismatch as RL stacks measure it: one home for the metrics, their bands and the
step-0 identities.

Plain torch code (no pytest, no pydantic), so the drift ladder, the module tier's training steps and
the e2e A/B lanes call the same functions:

* metrics.py: :data:`METRICS`, the table of mismatch metrics (formula, the peer that uses it) and
  :func:`mismatch_metrics` computing every one of them from ``(train_logp, rollout_logp, mask)``;
* gates.py: the default bands (each with its source), vime's absolute ceiling
  ``train_rollout_logprob_abs_diff <= 0.1`` and the per-step check "every step within the band";
* identities.py: the step-0 identities (``ppo_kl`` and ``kl_loss`` are 0, the ratio is 1 where the
  old policy, the reference and the current one are the same weights), within the op's tolerance.
"""

from pytest_rlk.mismatch.gates import (
    DEFAULT_BANDS,
    VIME_ABS_DIFF_CEILING,
    VIME_ABS_DIFF_CEILING_SOURCE,
    MetricBand,
    band_problems,
    every_step_within,
    vime_ceiling,
)
from pytest_rlk.mismatch.identities import Step0Tolerance, step0_problems, step0_tolerance
from pytest_rlk.mismatch.metrics import (
    LOGGED_AS,
    METRICS,
    MetricDef,
    MismatchError,
    MismatchMetrics,
    from_logged,
    mismatch_metrics,
)

__all__ = ["DEFAULT_BANDS", "LOGGED_AS", "METRICS", "VIME_ABS_DIFF_CEILING", "VIME_ABS_DIFF_CEILING_SOURCE", "MetricBand",
           "MetricDef", "MismatchError", "MismatchMetrics", "Step0Tolerance", "band_problems", "every_step_within",
           "from_logged", "mismatch_metrics", "step0_problems", "step0_tolerance", "vime_ceiling"]
