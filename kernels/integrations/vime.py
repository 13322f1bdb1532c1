"""vime adapter: our kernels inside vime's training loss through its public hooks (no vime change).

Install (vime flags; this module must be importable in the Ray workers, e.g. on PYTHONPATH)::

    --loss-type custom_loss --custom-loss-function-path kernels.integrations.vime.policy_loss
    --custom-megatron-init-path kernels.integrations.vime.init_hook

``policy_loss(args, batch, logits, sum_of_sample_mean) -> (loss, {name: 0-dim tensor})`` is vime's
custom-loss signature. It reproduces vime's policy loss (policy term, KL term, reductions) in three
timed stages, each an op of the public ``kernels`` API that ``kernels.dispatch`` routes to our
Triton kernels when ``VIME_RL_KERNEL=1`` and to the fp32 reference otherwise:

1. ``kernels.logp`` on the response slice of the logits (vocab-parallel over the TP group) -> ``rlk_logp_ms``
2. ``kernels.ratio_kl`` (the KL term per token)                                          -> ``rlk_ratio_kl_ms``
3. policy term, TIS, GSPO and reductions: ``kernels.reference.reduce_grpo_loss`` (O(T)) -> ``rlk_loss_ms``

Batch contract (vime's packed "THD" micro-batch; per-sample entries are lists of 1-D tensors or
one concatenated tensor): ``tokens`` (packed ids [T_total]) or ``unconcat_tokens`` (list of
[total_i]); ``total_lengths``, ``response_lengths`` (ints); ``loss_masks``, ``log_probs`` (old),
``advantages``, optional ``ref_log_probs``, ``rollout_log_probs`` (each [response_i]). ``logits``:
fp32 [T_total, V_local] or [1, T_total, V_local]. Sample i occupies ``[s_i, s_i + total_i)``; its
response log-probs come from logits rows ``[e_i - R_i - 1, e_i - 1)`` against tokens
``[e_i - R_i, e_i)`` (shift by one), with ``e_i = s_i + total_i``, ``R_i = response_lengths[i]``.

Settings this path does not implement (``unsupported_reasons``) hand the call to vime's native loss
(dotted path in ``VIME_RL_KERNEL_NATIVE_LOSS``, default ``vime.backends.megatron_utils.loss:
policy_loss_function``) with one WARNING naming the reason, or raise ``KernelFallbackError`` under
``VIME_RL_KERNEL_STRICT=1``. Metrics added: ``rlk_fallback`` (1.0 when this call or any op inside it
fell back, else 0.0), ``rlk_backend__<id>`` = 1.0 (the backend id, encoded in the key because vime
metrics are scalar tensors; ``backend_from_metrics`` decodes it; ``vime-native`` after an
adapter-level fallback), and the three stage times (CUDA
events on GPU, ``time.perf_counter`` on CPU; forward only: backward runs later, inside Megatron).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import kernels
from kernels import dispatch, reference, settings
from kernels.contracts import LossInputs

log = logging.getLogger(__name__)

NATIVE_LOSS_ENV = settings.NATIVE_LOSS.name
DEFAULT_NATIVE_LOSS = settings.NATIVE_LOSS.default
NATIVE_BACKEND_ID = "vime-native"  # the backend key's value when the adapter handed the call to vime
# The op name the adapter's own fallback is reported under (strict errors, log lines).
ADAPTER_OP = "vime_policy_loss"
BACKEND_METRIC_PREFIX = "rlk_backend__"
STAGE_METRICS = ("rlk_logp_ms", "rlk_ratio_kl_ms", "rlk_loss_ms")
SUPPORTED_QKV_FORMATS = ("thd",)


# ----------------------------------------------------------------------------- settings
def _arg(args: Any, name: str, default: Any) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def unsupported_reasons(args: Any) -> list[str]:
    """Reasons this adapter cannot serve vime's settings in ``args`` (empty = supported).

    Each names the vime flag: entropy bonus (``--entropy-coef``; entropy is not materialized),
    context parallel (``--context-parallel-size``), a qkv format other than thd, temperature <= 0.
    """
    reasons = []
    if float(_arg(args, "entropy_coef", 0.0)) != 0.0:
        reasons.append(f"entropy requested (--entropy-coef={args.entropy_coef})")
    if int(_arg(args, "context_parallel_size", 1)) > 1:
        reasons.append(f"context parallel > 1 (--context-parallel-size={args.context_parallel_size})")
    qkv_format = str(_arg(args, "qkv_format", "thd"))
    if qkv_format not in SUPPORTED_QKV_FORMATS:
        reasons.append(f"qkv format not thd (--qkv-format={qkv_format})")
    if float(_arg(args, "rollout_temperature", 1.0)) <= 0.0:
        reasons.append(f"temperature <= 0 (--rollout-temperature={args.rollout_temperature})")
    return reasons


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
        use_tis=bool(_arg(args, "use_tis", False)),
        tis_clip_low=float(_arg(args, "tis_clip_low", 0.0)),
        tis_clip_high=float(_arg(args, "tis_clip", 2.0)),
        reduction="per_token_sum" if bool(_arg(args, "calculate_per_token_loss", False)) else "sum_of_sample_mean",
        gspo=str(_arg(args, "advantage_estimator", "grpo")) == "gspo",
    )


# ----------------------------------------------------------------------------- packing
@dataclasses.dataclass
class PackedResponses:
    """The response tokens of a packed micro-batch, concatenated sample after sample ([R] = sum R_i)."""

    logits: torch.Tensor  # [R, V_local], rows predicting each response token
    target_ids: torch.Tensor  # [R] int64 global ids
    lengths: torch.Tensor  # [B] int64 response lengths
    loss_mask: torch.Tensor  # [R]
    old_logp: torch.Tensor  # [R] fp32
    advantages: torch.Tensor  # [R] fp32
    ref_logp: torch.Tensor | None  # [R] fp32
    rollout_logp: torch.Tensor | None  # [R] fp32

    def loss_inputs(self, config: kernels.LossConfig) -> LossInputs:
        return LossInputs(old_logp=self.old_logp, ref_logp=self.ref_logp, advantages=self.advantages,
                          loss_mask=self.loss_mask, lengths=self.lengths, config=config,
                          rollout_logp=self.rollout_logp)


def _cat(batch: dict, key: str, device: torch.device, total: int, dtype: torch.dtype | None) -> torch.Tensor:
    value = batch[key]
    if isinstance(value, torch.Tensor):
        out = value.reshape(-1)
    elif isinstance(value, Sequence) and value and all(isinstance(v, torch.Tensor) for v in value):
        out = torch.cat([v.reshape(-1) for v in value])
    else:
        raise TypeError(f"batch[{key!r}] must be a tensor or a non-empty list of tensors, got {type(value).__name__}")
    if out.numel() != total:
        raise ValueError(f"batch[{key!r}] has {out.numel()} values, expected sum(response_lengths) = {total}")
    out = out.to(device)
    return out if dtype is None else out.to(dtype)


def _int_list(batch: dict, key: str) -> list[int]:
    if key not in batch:
        raise KeyError(f"batch is missing {key!r} (vime's packed batch carries it)")
    value = batch[key]
    return [int(v) for v in (value.tolist() if isinstance(value, torch.Tensor) else value)]


def pack_responses(batch: dict, logits: torch.Tensor) -> PackedResponses:
    """Map vime's packed batch + logits onto per-response-token tensors (see the module docstring)."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"logits must be [T, V] or [1, T, V] (packed THD), got shape {tuple(logits.shape)}")
        logits = logits[0]
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V] or [1, T, V] (packed THD), got shape {tuple(logits.shape)}")
    total_lengths = _int_list(batch, "total_lengths")
    response_lengths = _int_list(batch, "response_lengths")
    if len(total_lengths) != len(response_lengths):
        raise ValueError(
            f"batch['total_lengths'] ({len(total_lengths)} samples) and batch['response_lengths'] "
            f"({len(response_lengths)}) disagree"
        )
    for i, (tot, resp) in enumerate(zip(total_lengths, response_lengths)):
        if not 0 < resp < tot:
            raise ValueError(f"sample {i}: response_lengths={resp} must be in [1, total_lengths={tot})")
    num_rows = sum(total_lengths)
    if logits.shape[0] < num_rows:
        raise ValueError(f"logits has {logits.shape[0]} rows, fewer than sum(total_lengths) = {num_rows}")
    device = logits.device
    if "tokens" in batch:
        tokens = batch["tokens"].reshape(-1)
    elif "unconcat_tokens" in batch:
        tokens = torch.cat([t.reshape(-1) for t in batch["unconcat_tokens"]])
    else:
        raise KeyError("batch needs 'tokens' (packed [T_total]) or 'unconcat_tokens' (list of [total_i])")
    if tokens.numel() < num_rows:
        raise ValueError(f"batch tokens have {tokens.numel()} ids, fewer than sum(total_lengths) = {num_rows}")
    rows, targets = [], []
    end = 0
    for tot, resp in zip(total_lengths, response_lengths):
        end += tot
        rows.append(torch.arange(end - resp - 1, end - 1))
        targets.append(torch.arange(end - resp, end))
    row_index = torch.cat(rows).to(device)
    target_index = torch.cat(targets).to(tokens.device)
    num_resp = int(row_index.numel())
    has_ref = batch.get("ref_log_probs") is not None
    has_rollout = batch.get("rollout_log_probs") is not None
    return PackedResponses(
        logits=logits.index_select(0, row_index),
        target_ids=tokens.index_select(0, target_index).to(device=device, dtype=torch.int64),
        lengths=torch.tensor(response_lengths, dtype=torch.int64, device=device),
        loss_mask=_cat(batch, "loss_masks", device, num_resp, None),
        old_logp=_cat(batch, "log_probs", device, num_resp, torch.float32),
        advantages=_cat(batch, "advantages", device, num_resp, torch.float32),
        ref_logp=_cat(batch, "ref_log_probs", device, num_resp, torch.float32) if has_ref else None,
        rollout_logp=_cat(batch, "rollout_log_probs", device, num_resp, torch.float32) if has_rollout else None,
    )


# ----------------------------------------------------------------------------- telemetry
class StageTimer:
    """Wall time of named stages: CUDA events on a GPU (one sync at ``results``), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[str, Any, Any]] = []

    def stage(self, name: str) -> _Stage:
        return _Stage(self, name)

    def _now(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def results_ms(self) -> dict[str, float]:
        if self._cuda and self._marks:
            self._marks[-1][2].synchronize()
            return {name: float(start.elapsed_time(end)) for name, start, end in self._marks}
        return {name: (end - start) * 1e3 for name, start, end in self._marks}


class _Stage:
    def __init__(self, timer: StageTimer, name: str) -> None:
        self._timer, self._name = timer, name

    def __enter__(self) -> None:
        self._start = self._timer._now()

    def __exit__(self, *exc: object) -> None:
        self._timer._marks.append((self._name, self._start, self._timer._now()))


def backend_metric_name(backend_id: str) -> str:
    """``rlk_backend__<id>`` with characters outside [A-Za-z0-9_.-] replaced by '_'."""
    return BACKEND_METRIC_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", backend_id)


def backend_from_metrics(metrics: dict[str, Any]) -> str | None:
    """The (sanitized) backend id encoded in a metrics dict, with or without vime's ``train/`` prefix."""
    for key in metrics:
        name = key.rsplit("/", 1)[-1]
        if name.startswith(BACKEND_METRIC_PREFIX):
            return name[len(BACKEND_METRIC_PREFIX):]
    return None


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


def _fall_back(reasons: list[str], args: Any, batch: dict, logits: torch.Tensor,
               sum_of_sample_mean: Callable) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    reason = "; ".join(reasons)
    if dispatch.strict_mode():
        raise kernels.KernelFallbackError(ADAPTER_OP, reason)
    try:
        native = load_native_loss()
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            f"vime policy_loss cannot use the kernels ({reason}) and vime's native loss is not importable "
            f"({err}); set {NATIVE_LOSS_ENV} or drop --custom-loss-function-path"
        ) from err
    log.warning("kernels: %s falls back to vime's native loss: %s", ADAPTER_OP, reason)
    loss, metrics = native(args, batch, logits, sum_of_sample_mean)
    metrics = dict(metrics)
    metrics["rlk_fallback"] = torch.ones((), device=loss.device)
    metrics[backend_metric_name(NATIVE_BACKEND_ID)] = torch.ones((), device=loss.device)
    return loss, metrics


def policy_loss(args: Any, batch: dict, logits: torch.Tensor,
                sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime custom loss (``--loss-type custom_loss``): see the module docstring for the contract."""
    reasons = unsupported_reasons(args)
    if reasons:
        return _fall_back(reasons, args, batch, logits, sum_of_sample_mean)
    config = loss_config_from_args(args)
    packed = pack_responses(batch, logits)
    if config.kl_loss_coef != 0.0 and packed.ref_logp is None:
        raise ValueError("batch['ref_log_probs'] is required with --use-kl-loss and --kl-loss-coef != 0")
    if config.use_tis and packed.rollout_logp is None:
        raise ValueError("batch['rollout_log_probs'] is required with --use-tis")
    temperature = float(_arg(args, "rollout_temperature", 1.0))
    tp_group = _tp_group(args)
    fallbacks_before = sum(kernels.fallback_counts().values())
    timer = StageTimer(packed.logits.device)
    use_kl = bool(_arg(args, "use_kl_loss", False)) and packed.ref_logp is not None

    with timer.stage("rlk_logp_ms"):
        logp = kernels.logp(packed.logits, packed.target_ids, temperature, tp_group=tp_group)
    with timer.stage("rlk_ratio_kl_ms"):
        if use_kl:
            _, kl = kernels.ratio_kl(logp, packed.old_logp, packed.ref_logp, packed.loss_mask,
                                     kl_type=config.kl_type, use_unbiased_kl=config.use_unbiased_kl)
        else:
            kl = torch.zeros_like(logp)
    with timer.stage("rlk_loss_ms"):
        # the reference's reduction (O(T) work), on the KL from stage 2
        loss, metrics = reference.reduce_grpo_loss(logp, packed.loss_inputs(config), packed.lengths, kl=kl)

    metrics = dict(metrics)
    if packed.rollout_logp is not None:
        # vime's definition: its own reduction of |old (training) - rollout (vLLM)| in log-prob space.
        metrics["train_rollout_logprob_abs_diff"] = sum_of_sample_mean(
            (packed.old_logp - packed.rollout_logp).abs()).detach()
    fell_back = sum(kernels.fallback_counts().values()) > fallbacks_before
    device = loss.device
    metrics["rlk_fallback"] = torch.tensor(float(fell_back), device=device)
    metrics[backend_metric_name(kernels.backend_id())] = torch.ones((), device=device)
    for name, ms in timer.results_ms().items():
        metrics[name] = torch.tensor(ms, device=device)
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
    Logs one INFO line; under ``VIME_RL_KERNEL_STRICT=1`` an unsupported setting raises
    ``KernelFallbackError`` here, before the first step."""
    global _INIT_DECISION
    if _INIT_DECISION is not None:
        return _INIT_DECISION
    decision = InitDecision(
        kernels_enabled=dispatch.kernels_enabled(),
        backend_id=kernels.backend_id(),
        reasons=tuple(unsupported_reasons(args)),
        strict=dispatch.strict_mode(),
    )
    if decision.reasons and decision.strict:
        raise kernels.KernelFallbackError(ADAPTER_OP, "; ".join(decision.reasons))
    log.info("%s", decision.line())
    _INIT_DECISION = decision
    return decision


def reset_init_decision() -> None:
    """Forget the cached init decision (tests; a process that changes its environment)."""
    global _INIT_DECISION
    _INIT_DECISION = None
