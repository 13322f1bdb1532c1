"""fp32 PyTorch references of vime's exact training-side math: the oracle every backend is judged by.

One file per topic; every function documents its shapes, dtypes and formula. The ops' arguments
and checks are their contracts' (kernels/contracts/); the reference imports nothing from
``kernels.ops``, so the oracle never depends on what it judges. Public import path:
``kernels.reference``.
"""

from __future__ import annotations

from kernels.contracts import LossConfig
from kernels.reference.advantages import (
    GRPO_STD_EPS,
    broadcast_to_tokens,
    grpo_advantages,
)
from kernels.reference.grpo_loss import (
    METRIC_NAMES,
    grpo_loss,
    grpo_loss_from_logp,
    reduce_grpo_loss,
)
from kernels.reference.kl import KL_TYPES, compute_kl
from kernels.reference.logprob import selected_logprob, vocab_parallel_selected_logprob
from kernels.reference.policy_loss import (
    gspo_sequence_log_ratio,
    gspo_sequence_ratio,
    policy_loss,
    tis_weights,
)
from kernels.reference.ratio_kl import ratio_kl
from kernels.reference.reductions import (
    REDUCTIONS,
    cu_seqlens_to_lengths,
    lengths_to_cu_seqlens,
    per_token_sum,
    reduce,
    resolve_lengths,
    sample_index,
    sum_of_sample_mean,
    token_weights,
)

__all__ = [
    "GRPO_STD_EPS",
    "KL_TYPES",
    "METRIC_NAMES",
    "REDUCTIONS",
    "LossConfig",
    "broadcast_to_tokens",
    "compute_kl",
    "cu_seqlens_to_lengths",
    "grpo_advantages",
    "grpo_loss",
    "grpo_loss_from_logp",
    "gspo_sequence_log_ratio",
    "gspo_sequence_ratio",
    "lengths_to_cu_seqlens",
    "per_token_sum",
    "policy_loss",
    "ratio_kl",
    "reduce",
    "reduce_grpo_loss",
    "resolve_lengths",
    "sample_index",
    "selected_logprob",
    "sum_of_sample_mean",
    "tis_weights",
    "token_weights",
    "vocab_parallel_selected_logprob",
]
