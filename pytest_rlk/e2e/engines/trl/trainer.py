"""TRL's GRPOTrainer with the suite's timings and metrics (runs in the arm's process only).

`TimedGRPOTrainer` times generation, the log-prob passes and the loss, and measures
`train_rollout_logprob_abs_diff`: the mean over samples of the masked token mean of |log-prob the
loss used - log-prob of the plain forward|, on the loss's own rows at the weights the rollout was
sampled with (one optimizer step per rollout). The loss's log-probs come from GRPOTrainer's own
path (TRL's fused LM head, or ours in the kernel arm); the plain forward's logits are what
transformers' generation samples from (the no-vLLM lane has no other rollout engine).

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
from pytest_rlk.e2e import metrics as m
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


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with timing hooks and the train/rollout log-prob diff."""

    def init_rlk(self, settings: TrlSettings) -> None:
        self.rlk_settings = settings
        self.rlk_step: dict[str, float] = {}

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
        elif self.rlk_settings.logprob_diff and self.rlk_settings.rollout == "hf":
            # The loss's own log-probs, at the weights the rollout was sampled with (one
            # optimizer step per rollout), against the rollout path on the same rows.
            self._rlk_add(m.ABS_DIFF, self._train_rollout_abs_diff(result[0], input_ids, attention_mask, logits_to_keep))
        return result

    def _compute_loss(self, model, inputs):
        self._sync()
        start = time.perf_counter()
        loss = super()._compute_loss(model, inputs)
        self._sync()
        self._rlk_add(m.LOSS_TIME, time.perf_counter() - start)
        return loss

    def _generate_and_score_completions(self, inputs):
        self._sync()
        start = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self._sync()
        self._rlk_add("_prepare_s", time.perf_counter() - start)
        self._rlk_add("_tokens", float(out["prompt_mask"].sum() + out["completion_mask"].sum()))
        return out

    @torch.no_grad()
    def _train_rollout_abs_diff(self, train_logps, input_ids, attention_mask, logits_to_keep) -> float:
        # Rollout path: the plain forward's logits, which transformers' generation samples from.
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1).logits
        logits = logits[:, :-1].float() / self.temperature
        completion_ids = input_ids[:, -logits_to_keep:]
        rollout_logps = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        mask = attention_mask[:, -logits_to_keep:].float()
        return masked_sample_mean((train_logps.detach().float() - rollout_logps).abs(), mask)


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
            m.OPTIMIZER_TIME: self.opt_time,
            m.TOKENS_PER_GPU_PER_S: step.get("_tokens", 0.0) / self.step_time,
            memory_name: memory_value,
            m.FALLBACK_COUNT: float(sum(kernels.fallback_counts().values())),
        }
        if "kl" in logs:
            row[m.KL_LOSS] = float(logs["kl"])
        if "clip_ratio/region_mean" in logs:
            row[m.PG_CLIPFRAC] = float(logs["clip_ratio/region_mean"])
        for name in (m.REF_LOG_PROBS_TIME, m.LOG_PROBS_TIME, m.ABS_DIFF):
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
