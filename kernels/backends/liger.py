"""The ``liger`` backend: Liger-Kernel's GRPO ops mapped onto our contract where the math is vime's.

Select it with ``VIME_RL_KERNEL_BACKEND=liger`` (a built-in name; ``--rlk-backend liger`` in the op
tier). Needs ``pip install liger-kernel`` (extra ``liger``). Each implementation takes the op's
checked call (kernels/contracts/) and adds only the checks Liger's math needs.

Ops served, and how each maps onto Liger (0.8.5):

``logp`` -> ``liger_kernel.ops.grpo_loss.fused_selective_log_softmax(logits [B, L+1, V], ids [B, L],
    temperature, mask)``. Liger's layout drops the last position of each row block, so the adapter
    copies our ``[T, V]`` logits into a ``[1, T+1, V]`` buffer (the extra row is never read). The
    temperature is always passed (Liger's default is 0.9). ``ignore_index`` rows go through Liger's
    own mask (its kernel skips them and leaves 0, which is our contract). Forward only: Liger runs
    it under ``torch.no_grad`` (so cases that need a backward are unsupported).

``grpo_loss`` -> ``liger_kernel.transformers.grpo_loss.triton_grpo_loss(..., reduce=False)``.
    Every token is its own Liger row (``[T, 2, V]`` logits after a one-row pad, ``advantages [T]``
    as "per-sequence" advantages of length-1 sequences), so per-token advantages are exact. Liger
    returns the per-token loss ``pg * tis + beta * k3`` (k3 times ``exp(logp - old)`` with
    ``use_bias_correction_kl``), the per-token k3 and the clip indicator; vime's reduction
    (``sum_of_sample_mean`` or ``per_token_sum`` with the loss mask as weights) is then applied to
    them here: the reduction is linear, so the loss and its gradient are vime's. The truncated IS
    weights ``clamp(exp(old - rollout), tis_clip_low, tis_clip_high)`` are computed here (a [T]
    function of the inputs) and passed as Liger's ``vllm_is_ratio``. Metrics: ``pg_loss``,
    ``pg_clipfrac`` and (when ``kl_loss_coef != 0``) ``kl_loss``; Liger does not expose the
    per-token log-prob, so ``ppo_kl`` is not produced (nor ``kl_loss`` when Liger skips the KL).

``linear_grpo_loss`` (hidden x LM head, no op of the public API yet) ->
    ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` with ``loss_type="bnpo"``: a masked mean
    over all tokens, which is vime's ``sum_of_sample_mean`` only for one packed sample.

Not vime's math, so declared unsupported: ``low_var_kl`` / ``k1`` / ``k2`` (Liger computes k3
only; ``low_var_kl`` clamps k3 to [-10, 10]); dual clip (Liger's ``delta`` is a different, upper
clamp); GSPO (Liger's sequence level needs a padded [B, L] layout, the adapter has one token per
row); vocab parallel; ``inplace_backward`` (Liger would write the gradient into the adapter's
padded copy, not into the caller's logits); ignore_index ids in the loss (Liger's kernel would index
the logits with them).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from kernels.backends import adapter_common as common
from kernels.backends.base import BaseBackend, Capabilities
from kernels.contracts import GrpoLossCall, LinearGrpoLossCall, LogpCall, LossConfig, LossInputs
from kernels.reference.policy_loss import tis_weights
from kernels.reference.reductions import reduce

BACKEND_ID = "liger"
LIGER_OPS = frozenset({"logp", "grpo_loss", "linear_grpo_loss"})
# Metrics each loss op returns (a subset of kernels.reference.METRIC_NAMES); "kl_loss" only when
# kl_loss_coef != 0 (Liger computes no KL otherwise).
GRPO_LOSS_METRICS = ("pg_loss", "pg_clipfrac", "kl_loss")
LOSS_FEATURE_REASONS = {
    "gspo": "GSPO: Liger's sequence-level ratio needs a padded [B, L] layout; the adapter maps one token per row",
    "dual_clip": "dual clip (eps_clip_c): Liger's `delta` is a different (upper) clamp of the ratio",
}
# Liger's chunked loss runs this many rows (tokens, one per row here) per chunk.
LINEAR_GRPO_CHUNK_ROWS = 1024


def _kl_reason(config: LossConfig) -> str | None:
    if config.kl_loss_coef != 0.0 and config.kl_type != "k3":
        return f"kl_type {config.kl_type}: Liger computes k3 only (low_var_kl also clamps to [-10, 10])"
    return None


def grpo_config_reason(config: LossConfig) -> str | None:
    """Why ``triton_grpo_loss`` cannot compute vime's loss for ``config``, or None."""
    return common.unsupported_loss_features(config, LOSS_FEATURE_REASONS) or _kl_reason(config)


def linear_grpo_config_reason(config: LossConfig, n_samples: int | None) -> str | None:
    """Why ``LigerFusedLinearGRPOLoss`` cannot compute vime's loss for ``config``, or None."""
    reason = grpo_config_reason(config)
    if reason is not None:
        return reason
    if config.reduction != "sum_of_sample_mean":
        return f"reduction {config.reduction}: LigerFusedLinearGRPOLoss ('bnpo') is a masked token mean"
    if n_samples is not None and n_samples != 1:
        return (
            f"{n_samples} packed samples: LigerFusedLinearGRPOLoss ('bnpo') averages over all tokens, "
            "which is vime's sum_of_sample_mean only for one sample"
        )
    return None


class LigerBackend(BaseBackend):
    """Liger-Kernel behind our op contract (see the module docstring for the mapping)."""

    id = BACKEND_ID

    def __init__(self) -> None:
        import liger_kernel.ops.grpo_loss as liger_ops  # ImportError here: liger-kernel not installed

        self._ops_module = liger_ops
        self.version = importlib.metadata.version("liger-kernel")
        self.capabilities = Capabilities(
            ops=LIGER_OPS,
            kl_types=frozenset({"k3"}),
            tp=False,
            extra={
                "forward_only_ops": ("logp",),
                "grpo_loss_metrics": GRPO_LOSS_METRICS,
                "grpo_loss_reduction": "per-token loss from Liger, vime's reduction applied by the adapter",
                "linear_grpo_loss_reduction": "Liger 'bnpo' (masked token mean): one packed sample only",
                "layout": "logits copied/padded into Liger's [B, L+1, V] layout",
            },
        )

    def supports(self, op: str, **case: Any) -> str | None:
        config = case.get("config")
        if op in ("grpo_loss", "linear_grpo_loss") and config is not None and config.kl_loss_coef == 0.0:
            # the KL type is irrelevant without a KL term: check the rest with k3
            case = {**case, "config": replace(config, kl_type="k3")}
        return super().supports(op, **case)

    def check_case(self, op: str, **case: Any) -> str | None:
        reason = common.triton_cpu_reason("Liger", case.get("device"), self._ops_module._selective_log_softmax_kernel)
        if reason is not None:
            return reason
        if op == "logp" and case.get("requires_grad"):
            return "Liger's fused_selective_log_softmax is forward-only (torch.no_grad)"
        config = case.get("config")
        if op == "grpo_loss" and config is not None:
            if case.get("inplace_backward"):
                return "inplace_backward: Liger would write the gradient into the adapter's padded copy"
            return grpo_config_reason(config)
        if op == "linear_grpo_loss":
            dtype = case.get("dtype")
            if dtype is not None and dtype != torch.float32:
                return (
                    f"{dtype} hidden: Liger's chunked loss rounds the logits to the input dtype (low-precision "
                    "matmul output), not the fp32-accumulated logits of the linear-op contract"
                )
            if config is not None:
                return linear_grpo_config_reason(config, case.get("num_samples"))
        return None

    def get(self, op: str) -> Callable[..., Any]:
        impls = {"logp": liger_logp, "grpo_loss": liger_grpo_loss, "linear_grpo_loss": liger_linear_grpo_loss}
        if op not in impls:
            raise KeyError(f"{self.id} does not implement {op!r}; it serves {sorted(impls)}")
        return impls[op]


def liger_logp(call: LogpCall) -> torch.Tensor:
    """Our ``logp`` contract on Liger's ``fused_selective_log_softmax``: fp32 [T], no autograd."""
    from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

    logits, target_ids = call.logits, call.target_ids
    common.require("vocab-parallel logp (tp_group given)" if call.tp_group is not None else None, BACKEND_ID, "logp")
    if logits.requires_grad and torch.is_grad_enabled():
        common.require("logits require grad but Liger's selective log-softmax is forward-only", BACKEND_ID, "logp")
    num_tokens, vocab = logits.shape
    buffer = logits.new_zeros((1, num_tokens + 1, vocab))
    buffer[0, :num_tokens].copy_(logits)
    keep = target_ids != call.ignore_index
    safe_ids = torch.where(keep, target_ids, torch.zeros_like(target_ids)).long()
    out = fused_selective_log_softmax(buffer, safe_ids[None], call.temperature, mask=keep[None].contiguous())
    return out[0]


def _tis(inputs: LossInputs) -> torch.Tensor | None:
    config = inputs.config
    if not config.use_tis:
        return None
    return tis_weights(inputs.old_logp, inputs.rollout_logp, config.tis_clip_low, config.tis_clip_high)


def liger_grpo_loss(call: GrpoLossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Our ``grpo_loss`` contract on Liger's ``triton_grpo_loss`` (see the module docstring)."""
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    config, logits, target_ids, ref_logp, loss_mask = call.config, call.logits, call.target_ids, call.ref_logp, call.loss_mask
    common.require(grpo_config_reason(config), BACKEND_ID, "grpo_loss")
    common.require("vocab-parallel loss (tp_group given)" if call.tp_group is not None else None, BACKEND_ID, "grpo_loss")
    common.require("inplace_backward" if call.inplace_backward else None, BACKEND_ID, "grpo_loss")
    common.check_ids_in_vocab(target_ids, logits.shape[1], BACKEND_ID, "grpo_loss")
    lens = call.sample_lengths(call.num_tokens, logits.device)
    beta = float(config.kl_loss_coef)
    tis = _tis(call)
    # one Liger row per token: [T, 1 + 1, V] (Liger never reads the pad row)
    rows = F.pad(logits[:, None, :], (0, 0, 0, 1)).contiguous()
    per_token, per_token_kl, clipped = triton_grpo_loss(
        rows,
        call.old_logp.float()[:, None].contiguous(),
        ref_logp.float()[:, None].contiguous() if (beta != 0.0 and ref_logp is not None) else None,
        target_ids.long()[:, None].contiguous(),
        call.advantages.float().contiguous(),
        completion_mask=None,  # vime's mask enters through the reduction below (weights allowed)
        temperature=call.temperature,
        beta=beta,
        eps_low=config.eps_clip,
        eps_high=config.eps_clip_high,
        inplace=False,
        loss_type="bnpo",  # irrelevant with reduce=False: every GRPO-family type has this per-token loss
        importance_sampling_level="token",
        reduce=False,
        vllm_is_ratio=None if tis is None else tis[:, None].contiguous(),
        use_bias_correction_kl=config.use_unbiased_kl,
    )
    per_token, clipped = per_token[:, 0], clipped[:, 0]
    loss = reduce(per_token, loss_mask, lens, config.reduction)
    metrics = {"pg_clipfrac": reduce(clipped, loss_mask, lens, config.reduction).detach()}
    if beta != 0.0:
        kl = per_token_kl[:, 0].detach()
        metrics["kl_loss"] = reduce(kl, loss_mask, lens, config.reduction)
        metrics["pg_loss"] = reduce(per_token.detach() - beta * kl, loss_mask, lens, config.reduction)
    else:
        metrics["pg_loss"] = loss.detach()
    return loss, metrics


def liger_linear_grpo_loss(call: LinearGrpoLossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's GRPO loss of ``hidden [T, H] @ weight [V, H].T (+ bias)`` on LigerFusedLinearGRPOLoss.

    Autograd to ``hidden``, ``weight`` and ``bias``. Returns ``(loss, {pg_loss, pg_clipfrac,
    kl_loss (when kl_loss_coef != 0)})``; one packed sample, ``sum_of_sample_mean`` only."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    config, ref_logp = call.config, call.ref_logp
    common.require(linear_grpo_config_reason(config, call.num_samples()), BACKEND_ID, "linear_grpo_loss")
    common.check_ids_in_vocab(call.target_ids, call.weight.shape[0], BACKEND_ID, "linear_grpo_loss")
    beta = float(config.kl_loss_coef)
    tis = _tis(call)
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=beta,
        compiled=False,  # eager loss math: no torch.compile warm-up per shape (the matmuls are the same)
        use_ref_model=beta != 0.0,
        chunk_size=LINEAR_GRPO_CHUNK_ROWS,
        epsilon_low=config.eps_clip,
        epsilon_high=config.eps_clip_high,
        loss_type="bnpo",
        temperature=call.temperature,
        use_bias_correction_kl=config.use_unbiased_kl,
    )
    loss, liger_metrics = loss_fn(
        call.hidden[:, None, :],
        call.weight,
        call.target_ids.long()[:, None],
        call.loss_mask.float()[:, None],
        call.advantages.float(),
        bias=call.bias,
        ref_per_token_logps=ref_logp.float()[:, None] if beta != 0.0 else None,
        old_per_token_logps=call.old_logp.float()[:, None],
        vllm_is_ratio=None if tis is None else tis[:, None],
    )
    metrics = {"pg_clipfrac": liger_metrics[-1].detach().float()}
    if beta != 0.0:
        kl_loss = liger_metrics[0].detach().float()
        metrics["kl_loss"] = kl_loss
        metrics["pg_loss"] = loss.detach().float() - beta * kl_loss  # bnpo: loss = mean(pg) + beta * mean(kl)
    else:
        metrics["pg_loss"] = loss.detach().float()
    return loss, metrics


def make_backend() -> LigerBackend:
    return LigerBackend()
