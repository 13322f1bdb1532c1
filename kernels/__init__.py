"""pytest-rlk's operators: vime's selected log-prob, ratio/KL and GRPO loss (and linear_logp).

Public API (docs/design/architecture.md): every function validates its inputs, then runs on the
backend chosen by :mod:`kernels.dispatch` (reference by default; ``VIME_RL_KERNEL=1`` turns on
the Triton kernels). ``kernels.reference`` holds the fp32 references of vime's exact math.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels import dispatch, reference, validation
from kernels.dispatch import (
    KernelFallbackError,
    backend_id,
    fallback_counts,
    fallback_reasons,
    reset_fallback_counts,
)
from kernels.reference.kl import check_kl_type
from kernels.reference.loss_config import LossConfig
from kernels.reference.ratio_kl import check_ratio_kl_inputs
from kernels.validation import IGNORE_INDEX

__rlk_kernels__ = True
__version__ = "0.1.0"


def _tp_world(tp_group: dist.ProcessGroup | None) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def _check_logits_input(logits: torch.Tensor, temperature: float) -> None:
    # structural checks before dispatch, so a bad input is an error, never a "fallback"; the
    # implementation repeats them together with the data-dependent ones (ids range)
    validation.check_logits(logits, check_finite=False)
    validation.check_temperature(temperature)


def _tensor_case(x: object) -> dict[str, object]:
    if not isinstance(x, torch.Tensor):
        return {}  # the implementation's validation names the bad input
    return {"device": x.device, "dtype": x.dtype, "shape": tuple(x.shape), "requires_grad": x.requires_grad}


def logp(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    tp_group: dist.ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Selected log-prob: logits [T, V] (or [T, V_local] with ``tp_group``) fp32|bf16|fp16,
    target_ids [T] global ids -> fp32 [T], autograd to logits. See kernels/ops/logp.py."""
    _check_logits_input(logits, temperature)
    case = {**_tensor_case(logits), "temperature": temperature, "tp_world": _tp_world(tp_group)}
    return dispatch.call("logp", case, logits, target_ids, temperature, tp_group=tp_group, ignore_index=ignore_index)


def ratio_kl(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_type: str = "low_var_kl",
    use_unbiased_kl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio [T], kl [T]) from fp32 [T] log-probs; autograd to ``logp``. See kernels/ops/ratio_kl.py."""
    check_kl_type(kl_type)
    check_ratio_kl_inputs(logp, old_logp, ref_logp, mask)
    case = {**_tensor_case(logp), "kl_type": kl_type, "use_unbiased_kl": use_unbiased_kl}
    return dispatch.call(
        "ratio_kl", case, logp, old_logp, ref_logp, mask, kl_type=kl_type, use_unbiased_kl=use_unbiased_kl
    )


def grpo_loss(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    config: LossConfig = LossConfig(),
    temperature: float = 1.0,
    rollout_logp: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's GRPO loss from logits -> (loss 0-dim fp32, {pg_loss, pg_clipfrac, ppo_kl, kl_loss}).
    See kernels/ops/grpo_loss.py (fused kernel) and kernels/reference/grpo_loss.py (math)."""
    _check_logits_input(logits, temperature)
    case = {
        **_tensor_case(logits),
        "temperature": temperature,
        "tp_world": _tp_world(tp_group),
        "config": config,
        "inplace_backward": inplace_backward,
        # [issue 9 backends] packed-sample count: adapters whose loss is one token mean need 1
        "num_samples": len(lengths) if isinstance(lengths, torch.Tensor) else (len(cu_seqlens) - 1 if isinstance(cu_seqlens, torch.Tensor) else 1),
    }
    return dispatch.call(
        "grpo_loss", case, logits, target_ids,
        old_logp=old_logp, ref_logp=ref_logp, advantages=advantages, loss_mask=loss_mask,
        lengths=lengths, cu_seqlens=cu_seqlens, config=config, temperature=temperature,
        rollout_logp=rollout_logp, tp_group=tp_group, inplace_backward=inplace_backward,
    )


def linear_logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    global_vocab: int | None = None,
) -> torch.Tensor:
    """Selected log-prob of ``hidden @ weight.T (+ bias)`` without materializing the logits.
    hidden [T, H], weight [V_local, H] -> fp32 [T]. Implemented in kernels/ops/linear_logp.py."""
    case = {**_tensor_case(hidden), "temperature": temperature, "tp_world": _tp_world(tp_group)}
    return dispatch.call(
        "linear_logp", case, hidden, weight, target_ids, bias, temperature,
        tp_group=tp_group, vocab_start=vocab_start, global_vocab=global_vocab,
    )


__all__ = [
    "IGNORE_INDEX",
    "KernelFallbackError",
    "LossConfig",
    "backend_id",
    "fallback_counts",
    "fallback_reasons",
    "grpo_loss",
    "linear_logp",
    "logp",
    "ratio_kl",
    "reference",
    "reset_fallback_counts",
]
