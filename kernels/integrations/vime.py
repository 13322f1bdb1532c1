"""vime adapter: our kernels inside vime's training loss through its public hooks (no vime change).

Install (vime flags, the SAME in both arms of an A/B; this module must be importable in the Ray
workers, e.g. on PYTHONPATH)::

    --loss-type custom_loss --custom-loss-function-path kernels.integrations.vime.policy_loss
    --custom-megatron-init-path kernels.integrations.vime.init_hook

and switch the kernels with the environment alone (``VIME_RL_KERNEL=1``). With the kernels off,
``policy_loss`` hands every call to vime's own ``policy_loss_function`` (dotted path in
``VIME_RL_KERNEL_NATIVE_LOSS``): both arms then go through vime's ``loss_function`` the same way, run
the same forwards (``--loss-type custom_loss`` turns vime's extra old-log-prob forward on in both) and
log the same keys; only the loss's arithmetic differs.

``policy_loss(args, batch, logits, sum_of_sample_mean) -> (loss, {name: 0-dim tensor})`` is vime's
custom-loss signature. With the kernels on it reproduces vime's policy loss for the configurations it
claims, in four timed stages:

1. ``kernels.logp`` on the response rows of the logits (vocab-parallel over the TP group) -> ``rlk_logp_ms``
2. the entropy of those rows (fp32, no autograd: vime logs ``entropy_loss`` always)     -> ``rlk_entropy_ms``
3. ``kernels.ratio_kl`` (the KL term per token, with ``--use-kl-loss``)                 -> ``rlk_ratio_kl_ms``
4. policy term, GSPO, TIS (``--use-tis`` or ``--get-mismatch-metrics``) per token from the fp32
   reference, every reduction through vime's own ``sum_of_sample_mean`` (its ``rollout_mask_sums``
   denominators, per-token or per-sample)                                                -> ``rlk_loss_ms``

It logs exactly the keys vime's ``policy_loss_function`` logs for the same arguments, in the same
order (``loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl``, ``train_rollout_logprob_abs_diff``,
``kl_loss``, ``ois, tis, tis_clipfrac, tis_abs``, ``opd_reverse_kl`` as vime decides), plus the ``rlk_*``
telemetry below.

Batch contract (vime's packed "THD" micro-batch; per-sample entries are lists of 1-D tensors or
one concatenated tensor): ``tokens`` (packed ids [T_total]) or ``unconcat_tokens`` (list of
[total_i]); ``total_lengths``, ``response_lengths`` (ints); ``loss_masks``, ``advantages``, optional
``log_probs`` (old; absent: the current ones, detached, as vime does), ``ref_log_probs``,
``rollout_log_probs`` (each [response_i]). ``logits``: fp32 [T_total, V_local] or [1, T_total, V_local].
Sample i occupies ``[s_i, s_i + total_i)``; its response log-probs come from logits rows
``[e_i - R_i - 1, e_i - 1)`` against tokens ``[e_i - R_i, e_i)`` (shift by one), with
``e_i = s_i + total_i``, ``R_i = response_lengths[i]``.

Settings this path does not implement exactly (``unsupported_reasons``: entropy bonus, context
parallel, other qkv formats, temperature <= 0, REINFORCE / CISPO / score centering,
``--use-rollout-logprobs``, a custom TIS function (icepop ...), OPSM, a custom pg-loss reducer,
top-p replay) hand the call to vime's native loss with ONE WARNING per reason per process, counted in
``native_fallbacks()`` and in ``rlk_fallback``; ``VIME_RL_KERNEL_STRICT=1`` raises
``KernelFallbackError`` instead.

Telemetry (the same keys in every call and both arms): ``rlk_fallback`` (1 when this call or an op
inside it fell back), ``rlk_backend__<id>`` (the backend id in the key, vime metrics being scalars;
``backend_from_metrics`` decodes it; ``vime-native`` when vime's loss ran), and the four stage times
(forward only: the GPU's own clock, kernels/device_clock.py, on a GPU; ``time.perf_counter`` on CPU).
When vime's loss ran, its whole time is ``rlk_loss_ms`` and the other stages are 0. vime sums every
``train/*`` value over micro-batches and DP x CP ranks and divides by the step's sample count (or
token count with ``--calculate-per-token-loss``; ``reduce_train_step_metrics``): each telemetry value
is therefore logged multiplied by the call's share of that denominator (``call_weight``), so
``train/rlk_fallback`` reads the fraction of calls that fell back and ``train/rlk_*_ms`` the mean
time per call.

No host sync: with the kernels on, a call and its backward never wait for the GPU (telemetry filled
on the device, host values sent through pinned memory), so a micro-batch never drains Megatron's
launch queue. Bad ids the kernels find raise ``kernels.DeviceInputError`` at a later call without
waiting (the next at the latest), or at ``kernels.raise_pending_errors()``; the rows they touch are
NaN until then.

The batch contract's packing is kernels/integrations/vime_batch.py, the telemetry
kernels/integrations/vime_telemetry.py; this module holds the hooks, the settings and the loss.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

import kernels
from kernels import device_errors, dispatch, reference, settings
from kernels.integrations.vime_batch import PackedResponses, _on_device, pack_responses
from kernels.integrations.vime_telemetry import (
    BACKEND_METRIC_PREFIX,
    STAGE_METRICS,
    StageTimer,
    _telemetry,
    backend_from_metrics,
)
from kernels.reference.policy_loss import gspo_sequence_log_ratio
from kernels.reference.reductions import sample_index

log = logging.getLogger(__name__)

NATIVE_LOSS_ENV = settings.NATIVE_LOSS.name
DEFAULT_NATIVE_LOSS = settings.NATIVE_LOSS.default
NATIVE_BACKEND_ID = "vime-native"  # the backend key's value when the adapter handed the call to vime
# The op name the adapter's own fallback is reported under (strict errors, log lines).
ADAPTER_OP = "vime_policy_loss"
SUPPORTED_QKV_FORMATS = ("thd",)


# ----------------------------------------------------------------------------- settings
def _arg(args: Any, name: str, default: Any) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def pg_loss_type(args: Any) -> str:
    """vime's policy-gradient objective for ``args``: ``--pg-loss-type``, else ``reinforce`` with
    score centering, ``cispo`` with ``--advantage-estimator cispo``, else ``ppo``."""
    configured = getattr(args, "pg_loss_type", None)
    if configured:
        return str(configured)
    if bool(_arg(args, "use_score_centering", False)):
        return "reinforce"
    return "cispo" if str(_arg(args, "advantage_estimator", "grpo")) == "cispo" else "ppo"


def unsupported_reasons(args: Any) -> list[str]:
    """Reasons this adapter cannot compute vime's loss for ``args`` exactly (empty = supported).

    Each names the vime flag. Supported: PPO/GRPO clipping (dual clip), GSPO, the KL term (every
    type, unbiased), vanilla TIS (``--use-tis`` / ``--get-mismatch-metrics``), per-token or
    per-sample(-rollout) reductions, temperature, vocab-parallel TP."""
    reasons = []
    if float(_arg(args, "entropy_coef", 0.0)) != 0.0:
        reasons.append(f"entropy bonus (--entropy-coef={args.entropy_coef}): the kernels give no entropy gradient")
    if int(_arg(args, "context_parallel_size", 1)) > 1:
        reasons.append(f"context parallel > 1 (--context-parallel-size={args.context_parallel_size})")
    qkv_format = str(_arg(args, "qkv_format", "thd"))
    if qkv_format not in SUPPORTED_QKV_FORMATS:
        reasons.append(f"qkv format not thd (--qkv-format={qkv_format})")
    if float(_arg(args, "rollout_temperature", 1.0)) <= 0.0:
        reasons.append(f"temperature <= 0 (--rollout-temperature={args.rollout_temperature})")
    objective = pg_loss_type(args)
    if objective != "ppo":
        reasons.append(f"policy-gradient loss {objective!r} (--pg-loss-type / --advantage-estimator cispo / "
                       "--use-score-centering): only ppo is implemented")
    if bool(_arg(args, "use_score_centering", False)):
        reasons.append("score centering (--use-score-centering)")
    if bool(_arg(args, "use_rollout_logprobs", False)):
        reasons.append("old log-probs from the rollout engine (--use-rollout-logprobs)")
    if getattr(args, "custom_tis_function_path", None):
        reasons.append(f"custom TIS function (--custom-tis-function-path={args.custom_tis_function_path})")
    if bool(_arg(args, "use_opsm", False)):
        reasons.append("OPSM masking (--use-opsm)")
    if getattr(args, "custom_pg_loss_reducer_function_path", None):
        reasons.append("custom pg-loss reducer (--custom-pg-loss-reducer-function-path="
                       f"{args.custom_pg_loss_reducer_function_path})")
    if float(_arg(args, "rollout_top_p", 1.0)) != 1.0:
        reasons.append(f"top-p replay (--rollout-top-p={args.rollout_top_p}): log-probs renormalized over kept tokens")
    return reasons


def tis_enabled(args: Any) -> bool:
    """vime applies the TIS weights to the policy term with ``--use-tis`` OR ``--get-mismatch-metrics``."""
    return bool(_arg(args, "use_tis", False)) or bool(_arg(args, "get_mismatch_metrics", False))


def loss_config_from_args(args: Any) -> kernels.LossConfig:
    """vime flags -> ``LossConfig``. KL term only with ``--use-kl-loss``; GSPO when
    ``--advantage-estimator gspo``; ``--calculate-per-token-loss`` -> ``per_token_sum``."""
    use_kl = bool(_arg(args, "use_kl_loss", False))
    eps_clip = float(_arg(args, "eps_clip", 0.2))
    return kernels.LossConfig(
        eps_clip=eps_clip,
        eps_clip_high=float(_arg(args, "eps_clip_high", eps_clip)),
        eps_clip_c=getattr(args, "eps_clip_c", None),
        kl_loss_coef=float(_arg(args, "kl_loss_coef", 0.0)) if use_kl else 0.0,
        kl_type=str(_arg(args, "kl_loss_type", "low_var_kl")),
        use_unbiased_kl=bool(_arg(args, "use_unbiased_kl", False)),
        use_tis=tis_enabled(args),
        tis_clip_low=float(_arg(args, "tis_clip_low", 0.0)),
        tis_clip_high=float(_arg(args, "tis_clip", 2.0)),
        reduction="per_token_sum" if bool(_arg(args, "calculate_per_token_loss", False)) else "sum_of_sample_mean",
        gspo=str(_arg(args, "advantage_estimator", "grpo")) == "gspo",
    )


def call_weight(args: Any, batch: dict) -> float | torch.Tensor:
    """This call's share of the denominator vime's ``reduce_train_step_metrics`` divides ``train/*`` by.

    vime sums each logged value over micro-batches and DP x CP ranks, then divides by the step's sample
    count (per-sample means) or its token count (``--calculate-per-token-loss``: the masked tokens,
    each sample at least 1, counted once per CP rank and multiplied back by the CP size). A per-call value
    ``v`` logged as ``v * call_weight`` therefore reads as the (sample- or token-weighted) mean of ``v``.
    The token count is a 0-dim fp32 tensor on the masks' device (reading it would wait for the device)."""
    cp = max(int(_arg(args, "context_parallel_size", 1)), 1)
    if bool(_arg(args, "calculate_per_token_loss", False)):
        counts = [m.reshape(-1).float().sum().clamp(min=1.0) for m in batch["loss_masks"]]
        return torch.stack(counts).sum() / cp
    return float(len(batch["response_lengths"])) / cp


# ----------------------------------------------------------------------------- the loss
def _tp_group(args: Any) -> Any:
    """Megatron's TP group when ``--tensor-model-parallel-size`` > 1 (logits are vocab shards)."""
    if int(_arg(args, "tensor_model_parallel_size", 1)) <= 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def load_native_loss() -> Callable:
    """vime's own policy loss (dotted path ``module:function`` from ``VIME_RL_KERNEL_NATIVE_LOSS``)."""
    path = settings.NATIVE_LOSS.get()
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{NATIVE_LOSS_ENV}={path!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module_name), attr)


_native_fallbacks: Counter[str] = Counter()


def native_fallbacks() -> dict[str, int]:
    """Calls handed to vime's loss because the adapter cannot serve them, per reason (this process)."""
    return dict(_native_fallbacks)


def reset_native_fallbacks() -> None:
    """Zero the counts; the next fallback of each reason logs its WARNING again (tests)."""
    _native_fallbacks.clear()



def _native(args: Any, batch: dict, logits: torch.Tensor, sum_of_sample_mean: Callable, *,
            fell_back: bool, why: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    try:
        native = load_native_loss()
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            f"vime's native loss {settings.NATIVE_LOSS.get()!r} serves this call ({why}) but is not importable "
            f"({err}); set {NATIVE_LOSS_ENV} or drop --custom-loss-function-path"
        ) from err
    timer = StageTimer(logits.device)
    with timer.stage("rlk_loss_ms"):
        loss, metrics = native(args, batch, logits, sum_of_sample_mean)
    return loss, _telemetry(metrics, fell_back=fell_back, backend=NATIVE_BACKEND_ID, stages_ms=timer.results_ms(),
                            weight=call_weight(args, batch), device=loss.device)


def _fall_back(reasons: list[str], args: Any, batch: dict, logits: torch.Tensor,
               sum_of_sample_mean: Callable) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    reason = "; ".join(reasons)
    if dispatch.strict_mode():
        raise kernels.KernelFallbackError(ADAPTER_OP, reason)
    if reason not in _native_fallbacks:
        log.warning("kernels: %s falls back to vime's native loss: %s", ADAPTER_OP, reason)
    _native_fallbacks[reason] += 1
    return _native(args, batch, logits, sum_of_sample_mean, fell_back=True, why=reason)


def response_entropy(logits: torch.Tensor, temperature: float, tp_group: Any) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per row, fp32, no autograd (vime's ``entropy_loss``
    metric; the adapter serves no entropy bonus). [R, V_local] -> [R]; vocab-parallel over ``tp_group``."""
    with torch.no_grad():
        z = logits.float() / temperature if temperature != 1.0 else logits.float()
        if tp_group is None:
            log_p = torch.log_softmax(z, dim=-1)
            return -(log_p.exp() * log_p).sum(dim=-1)
        import torch.distributed as dist

        zmax = z.max(dim=-1).values
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=tp_group)
        e = torch.exp(z - zmax[:, None])
        sums = torch.stack([e.sum(dim=-1), (e * z).sum(dim=-1)])
        dist.all_reduce(sums, group=tp_group)
        return torch.log(sums[0]) + zmax - sums[1] / sums[0]


def policy_loss(args: Any, batch: dict, logits: torch.Tensor,
                sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime custom loss (``--loss-type custom_loss``): see the module docstring for the contract."""
    if not dispatch.kernels_enabled():
        return _native(args, batch, logits, sum_of_sample_mean, fell_back=False, why="the kernels are off")
    reasons = unsupported_reasons(args)
    if reasons:
        return _fall_back(reasons, args, batch, logits, sum_of_sample_mean)
    config = loss_config_from_args(args)
    use_kl = bool(_arg(args, "use_kl_loss", False))
    packed = pack_responses(batch, logits)
    if use_kl and packed.ref_logp is None:
        raise ValueError("batch['ref_log_probs'] is required with --use-kl-loss")
    if config.use_tis and packed.rollout_logp is None:
        raise ValueError("batch['rollout_log_probs'] is required with --use-tis / --get-mismatch-metrics")
    temperature = float(_arg(args, "rollout_temperature", 1.0))
    tp_group = _tp_group(args)
    fallbacks_before = sum(kernels.fallback_counts().values())
    timer = StageTimer(packed.logits.device)

    with timer.stage("rlk_logp_ms"):
        logp = kernels.logp(packed.logits, packed.target_ids, temperature, tp_group=tp_group)
    with timer.stage("rlk_entropy_ms"):
        entropy = response_entropy(packed.logits, temperature, tp_group)
    # vime: without old log-probs in the batch the current ones (detached) are the old ones
    old_logp = packed.old_logp if packed.old_logp is not None else logp.detach()
    with timer.stage("rlk_ratio_kl_ms"):
        kl = None
        if use_kl:
            _, kl = kernels.ratio_kl(logp, old_logp, packed.ref_logp, packed.loss_mask,
                                     kl_type=config.kl_type, use_unbiased_kl=config.use_unbiased_kl)
    with timer.stage("rlk_loss_ms"):
        loss, metrics = _reduce(config, packed, logp, old_logp, entropy, kl, batch, logits, sum_of_sample_mean)

    fell_back = sum(kernels.fallback_counts().values()) > fallbacks_before
    # bad ids the kernels have found so far (this call's once they have run: the next call's at the
    # latest) raise here, read without waiting for the device
    device_errors.raise_if_reported(loss.device)
    return loss, _telemetry(metrics, fell_back=fell_back, backend=kernels.backend_id(), stages_ms=timer.results_ms(),
                            weight=call_weight(args, batch), device=loss.device)


def _reduce(config: kernels.LossConfig, packed: PackedResponses, logp: torch.Tensor, old_logp: torch.Tensor,
            entropy: torch.Tensor, kl: torch.Tensor | None, batch: dict, logits: torch.Tensor,
            sum_of_sample_mean: Callable) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's policy term and metrics from per-token values, reduced by vime's ``sum_of_sample_mean``."""
    log_ratio = None
    if config.gspo:
        num_samples = int(packed.lengths.shape[0])
        # the token count given: repeat_interleave would read it from the device otherwise
        log_ratio = gspo_sequence_log_ratio(logp, old_logp, packed.loss_mask,
                                            sample_index(packed.lengths, logp.shape[0]), num_samples)
    pg, clipfrac, ppo_kl = reference.policy_loss(logp, old_logp, packed.advantages, config.eps_clip,
                                                 config.eps_clip_high, config.eps_clip_c, log_ratio=log_ratio)
    if log_ratio is not None:
        ppo_kl = -log_ratio  # vime logs GSPO's sequence KL
    tis_metrics = {}
    if config.use_tis:
        train_logp = packed.old_logp if packed.old_logp is not None else logp.detach()
        ratio = torch.exp(train_logp - packed.rollout_logp)
        weights = ratio.clamp(min=config.tis_clip_low, max=config.tis_clip_high)
        pg = pg * weights
        tis_metrics = {"ois": (-ppo_kl).exp().detach(), "tis": ratio.detach(),
                       "tis_clipfrac": (weights != ratio).float(), "tis_abs": (ratio - 1).abs().detach()}
    pg_loss = sum_of_sample_mean(pg)
    pg_clipfrac = sum_of_sample_mean(clipfrac)
    ppo_kl_mean = sum_of_sample_mean(ppo_kl)
    entropy_loss = sum_of_sample_mean(entropy)
    loss = pg_loss  # the entropy bonus is not served (unsupported_reasons)
    kl_loss = None
    if kl is not None:
        kl_loss = sum_of_sample_mean(kl)
        loss = loss + config.kl_loss_coef * kl_loss
    if logp.numel() == 0:
        loss = loss + 0 * logits.sum()
    metrics = {"loss": loss.detach(), "pg_loss": pg_loss.detach(), "entropy_loss": entropy_loss.detach(),
               "pg_clipfrac": pg_clipfrac.detach(), "ppo_kl": ppo_kl_mean.detach()}
    if packed.rollout_logp is not None:
        metrics["train_rollout_logprob_abs_diff"] = sum_of_sample_mean((old_logp - packed.rollout_logp).abs()).detach()
    if kl_loss is not None:
        metrics["kl_loss"] = kl_loss.detach()
    for name, value in tis_metrics.items():
        metrics[name] = sum_of_sample_mean(value).detach()
    opd = batch.get("opd_reverse_kl")
    if opd is not None and len(opd) > 0:
        values = torch.cat([v.reshape(-1) for v in opd]) if not isinstance(opd, torch.Tensor) else opd.reshape(-1)
        metrics["opd_reverse_kl"] = sum_of_sample_mean(_on_device(values, logp.device)).detach()
    return loss, metrics


# ----------------------------------------------------------------------------- init hook
@dataclasses.dataclass(frozen=True)
class InitDecision:
    """What ``init_hook`` found: kernels on or off, the backend, and why."""

    kernels_enabled: bool
    backend_id: str
    reasons: tuple[str, ...]
    strict: bool

    def line(self) -> str:
        state = "active" if self.kernels_enabled and not self.reasons else "inactive"
        why = f"; fallback: {'; '.join(self.reasons)}" if self.reasons else ""
        return f"rlk vime loss provider {state}: backend={self.backend_id} strict={self.strict}{why}"


_INIT_DECISION: InitDecision | None = None


def init_hook(args: Any) -> InitDecision:
    """``--custom-megatron-init-path`` hook, ``fn(args)`` after model-parallel init.

    Checks once per process (later calls return the first decision): whether the kernels are
    enabled (``VIME_RL_KERNEL``), the backend id, and the settings the custom loss cannot serve.
    Logs one INFO line; with the kernels on and ``VIME_RL_KERNEL_STRICT=1`` an unsupported setting
    raises ``KernelFallbackError`` here, before the first step (with them off, vime's loss serves
    every call and nothing falls back)."""
    global _INIT_DECISION
    if _INIT_DECISION is not None:
        return _INIT_DECISION
    decision = InitDecision(
        kernels_enabled=dispatch.kernels_enabled(),
        backend_id=kernels.backend_id(),
        reasons=tuple(unsupported_reasons(args)),
        strict=dispatch.strict_mode(),
    )
    if decision.reasons and decision.strict and decision.kernels_enabled:
        raise kernels.KernelFallbackError(ADAPTER_OP, "; ".join(decision.reasons))
    log.info("%s", decision.line())
    _INIT_DECISION = decision
    return decision


def reset_init_decision() -> None:
    """Forget the cached init decision (tests; a process that changes its environment)."""
    global _INIT_DECISION
    _INIT_DECISION = None


# The adapter's public names (its telemetry and batch helpers live in vime_telemetry.py and
# vime_batch.py; callers name them here).
__all__ = [
    "ADAPTER_OP",
    "BACKEND_METRIC_PREFIX",
    "DEFAULT_NATIVE_LOSS",
    "InitDecision",
    "NATIVE_BACKEND_ID",
    "NATIVE_LOSS_ENV",
    "PackedResponses",
    "STAGE_METRICS",
    "SUPPORTED_QKV_FORMATS",
    "StageTimer",
    "backend_from_metrics",
    "call_weight",
    "init_hook",
    "load_native_loss",
    "loss_config_from_args",
    "native_fallbacks",
    "pack_responses",
    "pg_loss_type",
    "policy_loss",
    "reset_init_decision",
    "reset_native_fallbacks",
    "response_entropy",
    "tis_enabled",
    "unsupported_reasons",
]
