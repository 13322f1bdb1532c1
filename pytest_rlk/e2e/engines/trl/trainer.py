"""TRL's GRPOTrainer with the suite's timings and metrics (runs in the arm's process only).

`TimedGRPOTrainer` times generation, the log-prob passes, the loss's forward and backward and the
optimizer, and measures `train_rollout_logprob_abs_diff`: the mean over samples of the masked
token mean of |log-prob the loss used - the sampler's log-prob|, on the loss's own rows at the
weights the rollout was sampled with (one optimizer step per rollout). The loss's log-probs come
from GRPOTrainer's own path (TRL's fused LM head, or ours in the kernel arm); the sampler's are
recorded at generation time by the rollout (`rollout.SamplerRollout`: transformers' KV-cache
decode), so the metric is decode against training forward plus precision, as in vime.

Where the kernel switches admit `ratio_kl`, the kernel arm computes the loss through
`kernels.integrations.trl.grpo_policy_loss` (vime's math, ratio and KL from our op) instead of
TRL's inline loss; it does so only for the configuration where the two are the same math
(`KERNEL_LOSS_CONFIG`) and refuses any other.

With a vLLM rollout (``trl.rollout: "vllm"``) the metric is TRL's own
`sampling/sampling_logp_difference/mean`: the training forward (the loss's log-prob path: TRL's
fused LM head, or ours in the kernel arm) against the log-probs vLLM sampled with, real
train/rollout drift.

`MetricsCallback` writes one JSON line per optimizer step in the canonical metric names
(`pytest_rlk.e2e.metrics`) to `metrics.jsonl` and, behind a prefix, to stdout (progress).
"""

from __future__ import annotations

import os
import platform
import resource
import time
from pathlib import Path

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

import kernels
from kernels.integrations import trl as trl_integration
from pytest_rlk.e2e import metrics as m
from pytest_rlk.mismatch import mismatch_metrics
from pytest_rlk.e2e.engines.trl.series import PROGRESS_PREFIX, step_line
from pytest_rlk.e2e.engines.trl.settings import TrlSettings
from pytest_rlk.platform import cpu_model

# TRL's own train/rollout drift with a vLLM rollout: the token mean over the batch of
# |log-prob of the training forward (its old_per_token_logps) - vLLM's sampling log-prob|.
VLLM_LOGP_DIFF = "sampling/sampling_logp_difference/mean"


def peak_memory_mib(device: str) -> tuple[str, float]:
    if device == "cuda":
        return m.PEAK_VRAM, torch.cuda.max_memory_allocated() / 2**20
    return m.PEAK_RSS, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def hardware(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, CUDA {torch.version.cuda}"
    return f"{cpu_model()} ({platform.machine()}), {os.cpu_count()} cores"


def masked_sample_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over samples of each sample's masked token mean (samples without tokens skipped)."""
    tokens = mask.sum(-1)
    keep = tokens > 0
    per_sample = (values * mask).sum(-1)[keep] / tokens[keep]
    return float(per_sample.mean()) if per_sample.numel() else 0.0


# TRL settings under which its inline loss is vime's math, the one the kernel loss computes:
# attribute of GRPOTrainer / GRPOConfig -> the value it must have.
KERNEL_LOSS_CONFIG = {
    "loss_type": "grpo", "importance_sampling_level": "token", "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None, "use_vllm": False, "aux_loss_enabled": False,
}
KERNEL_LOSS_ARGS = {"delta": None}


def kernel_loss_refusals(trainer: GRPOTrainer) -> list[str]:
    """The settings of ``trainer`` under which TRL's loss is not the math the kernel loss computes."""
    found = [f"{name} = {getattr(trainer, name, None)!r} (needs {want!r})" for name, want in KERNEL_LOSS_CONFIG.items()
             if getattr(trainer, name, None) != want]
    found += [f"args.{name} = {getattr(trainer.args, name, None)!r} (needs {want!r})"
              for name, want in KERNEL_LOSS_ARGS.items() if getattr(trainer.args, name, None) != want]
    if getattr(trainer, "_entropy_bonus_enabled", False):
        found.append("an entropy bonus (entropy_coef != 0)")
    return found


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with timing hooks, the train/rollout log-prob diff and, in a kernel arm that
    routes ``ratio_kl``, the kernel loss."""

    def init_rlk(self, settings: TrlSettings, *, kernel_loss: bool = False) -> None:
        self.rlk_settings = settings
        self.rlk_step: dict[str, float] = {}
        self.rlk_kernel_loss = kernel_loss
        self._rlk_inputs: dict | None = None
        if kernel_loss:
            refusals = kernel_loss_refusals(self)
            if refusals:
                raise ValueError("the kernel loss (ratio_kl in VIME_RL_KERNEL_OPS) computes vime's GRPO loss, which "
                                 "is TRL's only for loss_type 'grpo' with a token-level ratio and no other term; "
                                 "this run has " + "; ".join(refusals))

    def _rlk_add(self, name: str, value: float) -> None:
        self.rlk_step[name] = self.rlk_step.get(name, 0.0) + value

    def _sync(self) -> None:
        if self.rlk_settings.device == "cuda":
            torch.cuda.synchronize()

    def _generate(self, prompts):
        self._sync()
        start = time.perf_counter()
        result = super()._generate(prompts)
        self._sync()
        self._rlk_add(m.ROLLOUT_TIME, time.perf_counter() - start)
        return result

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        self._sync()
        start = time.perf_counter()
        result = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        self._sync()
        elapsed = time.perf_counter() - start
        if model is self.ref_model:
            self._rlk_add(m.REF_LOG_PROBS_TIME, elapsed)
        elif not torch.is_grad_enabled():
            self._rlk_add(m.LOG_PROBS_TIME, elapsed)
        elif self.rlk_settings.logprob_diff and self.rlk_settings.rollout == "hf" and self._rlk_inputs is not None:
            # The loss's own log-probs, at the weights the rollout was sampled with (one
            # optimizer step per rollout), against the sampler's on the same tokens.
            sampled = self._rlk_inputs.get("sampling_per_token_logps")
            if sampled is None:
                raise RuntimeError("the rollout recorded no sampler log-probs (rollout_func 'logprobs')")
            mask = self._rlk_inputs["completion_mask"].float()
            self._rlk_add(m.ABS_DIFF, masked_sample_mean((result[0].detach().float() - sampled.float()).abs(), mask))
            # the whole mismatch table (pytest_rlk.mismatch) of this step, as the field reads it
            table = mismatch_metrics(result[0].detach().float(), sampled.float(), mask).values()
            self.rlk_step.update({name: value for name, value in table.items() if name in m.MISMATCH_REPORTED})
        return result

    def training_step(self, model, inputs, num_items_in_batch):
        self._sync()
        start = time.perf_counter()
        prepared_before = self.rlk_step.get("_prepare_s", 0.0)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._sync()
        prepare = self.rlk_step.get("_prepare_s", 0.0) - prepared_before
        self._rlk_add(m.LOSS_FWD_BWD_TIME, time.perf_counter() - start - prepare)
        return loss

    def _compute_loss(self, model, inputs):
        self._sync()
        start = time.perf_counter()
        self._rlk_inputs = inputs
        try:
            loss = self._rlk_kernel_policy_loss(model, inputs) if self.rlk_kernel_loss else super()._compute_loss(model, inputs)
        finally:
            self._rlk_inputs = None
        self._sync()
        self._rlk_add(m.LOSS_TIME, time.perf_counter() - start)
        return loss

    def _rlk_kernel_policy_loss(self, model, inputs):
        """vime's GRPO loss through ``kernels.ratio_kl`` (``grpo_policy_loss``), with the metrics
        TRL's own loss logs (kl, entropy, clip ratios) under TRL's names."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        per_token_logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True)
        old = inputs.get("old_per_token_logps")
        old = per_token_logps.detach() if old is None else old
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        loss, stats = trl_integration.grpo_policy_loss(
            per_token_logps, old, ref, inputs["advantages"], completion_mask,
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, beta=self.beta,
            unbiased_kl=bool(self.args.use_bias_correction_kl))
        mode = "train" if self.model.training else "eval"
        weights = completion_mask.float()

        def masked_mean(x: torch.Tensor) -> float:
            return float((x.float() * weights).sum() / weights.sum().clamp(min=1.0))

        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(masked_mean(stats["kl"]))
        self._metrics[mode]["entropy"].append(masked_mean(entropies.detach()))
        self._metrics[mode]["clip_ratio/region_mean"].append(masked_mean(stats["clipped"]))
        return loss / (self.current_gradient_accumulation_steps if mode == "train" else 1.0)

    def _generate_and_score_completions(self, inputs):
        self._sync()
        start = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self._sync()
        self._rlk_add("_prepare_s", time.perf_counter() - start)
        self._rlk_add("_tokens", float(out["prompt_mask"].sum() + out["completion_mask"].sum()))
        return out


class MetricsCallback(TrainerCallback):
    """One JSON line per optimizer step in the suite's canonical metric names; `trainer` is set
    once the trainer exists (it reads the trainer's per-step timings)."""

    def __init__(self, settings: TrlSettings, metrics_path: Path) -> None:
        self.settings, self.metrics_path = settings, metrics_path
        self.trainer: TimedGRPOTrainer | None = None
        self.step_start = self.step_time = self.opt_start = self.opt_time = 0.0
        self.rows = 0
        metrics_path.write_text("")

    def _sync(self) -> None:
        if self.settings.device == "cuda":
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        assert self.trainer is not None
        self.trainer.rlk_step = {}
        if self.settings.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self._sync()
        self.step_start = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._sync()
        self.opt_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._sync()
        self.opt_time = time.perf_counter() - self.opt_start

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.step_time = time.perf_counter() - self.step_start

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "reward" not in logs or self.trainer is None:  # the end-of-training summary line
            return
        step = self.trainer.rlk_step
        memory_name, memory_value = peak_memory_mib(self.settings.device)
        row: dict[str, float | int] = {
            "step": self.rows,
            m.RAW_REWARD: float(logs["reward"]),
            m.LOSS: float(logs["loss"]),
            m.GRAD_NORM: float(logs["grad_norm"]),
            m.ENTROPY: float(logs["entropy"]),
            m.RESPONSE_LENGTH: float(logs["completions/mean_length"]),
            m.STEP_TIME: self.step_time,
            m.ROLLOUT_TIME: step.get(m.ROLLOUT_TIME, 0.0),
            m.ACTOR_TRAIN_TIME: self.step_time - step.get("_prepare_s", 0.0),
            m.LOSS_TIME: step.get(m.LOSS_TIME, 0.0),
            m.LOSS_FWD_BWD_TIME: step.get(m.LOSS_FWD_BWD_TIME, 0.0),
            m.OPTIMIZER_TIME: self.opt_time,
            m.TOKENS_PER_GPU_PER_S: step.get("_tokens", 0.0) / self.step_time,
            memory_name: memory_value,
            m.FALLBACK_COUNT: float(sum(kernels.fallback_counts().values())),
        }
        if "kl" in logs:
            row[m.KL_LOSS] = float(logs["kl"])
        if "clip_ratio/region_mean" in logs:
            row[m.PG_CLIPFRAC] = float(logs["clip_ratio/region_mean"])
        for name in (m.REF_LOG_PROBS_TIME, m.LOG_PROBS_TIME, m.ABS_DIFF, *m.MISMATCH_REPORTED):
            if name in step:
                row[name] = step[name]
        if self.settings.rollout == "vllm" and self.settings.logprob_diff:
            if VLLM_LOGP_DIFF not in logs:
                raise RuntimeError(f"rollout 'vllm': TRL logged no {VLLM_LOGP_DIFF!r} (is vllm_importance_sampling_correction off?)")
            row[m.ABS_DIFF] = float(logs[VLLM_LOGP_DIFF])
        line = step_line(row)
        with self.metrics_path.open("a") as f:
            f.write(line + "\n")
        print(PROGRESS_PREFIX + line, flush=True)
        self.rows += 1
