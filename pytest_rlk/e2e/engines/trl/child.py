"""One arm of a TRL A/B: a real TRL ``GRPOTrainer`` run, in the arm's own process.

    python -m pytest_rlk.e2e.engines.trl.child --spec SPEC.json --arm baseline|kernels --out DIR

Both arms build the same tiny real model (``tiny_models``; same seed, so identical weights,
checked by a weight digest in ``run_info.json``), train on the same synthetic task (``task``) with
identical seeds and settings. The kernel arm differs only by the spec's kernel switch environment;
with it, ``kernels.integrations.trl`` routes TRL's per-token log-probs through ``kernels.logp``.
With ``trl.rollout: "vllm"`` a colocated vLLM engine samples the responses (``vllm_rollout``).
Writes ``DIR/metrics.jsonl`` (``trainer.MetricsCallback``) and ``DIR/run_info.json`` (versions,
backend id, fallback counts and reasons, patched-call counts, settings, environment).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import GRPOConfig

import kernels
from kernels.integrations import trl as trl_integration
from pytest_rlk.e2e.engines.task import make_prompts, repeat_reward_func
from pytest_rlk.e2e.engines.tiny_models import TinyModelSize, build_tiny_model_dir
from pytest_rlk.e2e.engines.trl import vllm_rollout
from pytest_rlk.e2e.engines.trl.series import METRICS_FILE, RUN_INFO_FILE
from pytest_rlk.e2e.engines.trl.settings import TINY_PREFIX, TrlSettings
from pytest_rlk.e2e.engines.trl.trainer import MetricsCallback, TimedGRPOTrainer, hardware
from pytest_rlk.e2e.spec import ABSpec, ArmRole, load_spec


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def local_checkpoint(spec: ABSpec) -> Path | None:
    """The spec's local HF checkpoint directory (checked), or None for a ``tiny:`` model."""
    checkpoint = spec.model.hf_checkpoint
    if checkpoint.startswith(TINY_PREFIX):
        return None
    path = Path(checkpoint)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model.hf_checkpoint {checkpoint!r}: no config.json there")
    return path


def model_dir(spec: ABSpec, settings: TrlSettings, out: Path) -> Path:
    local = local_checkpoint(spec)
    if local is not None:
        return local
    size = TinyModelSize.from_dict(dict(settings.model_size))
    kind = spec.model.hf_checkpoint[len(TINY_PREFIX):]
    return build_tiny_model_dir(out / "model", kind, size, seed=spec.seeds.seed, extra_vocab=settings.extra_vocab)


def check_arm_env(arm: ArmRole, spec: ABSpec) -> None:
    """The arm flag must agree with the environment the launcher set (the switch is the env)."""
    missing = {k: v for k, v in spec.kernel_switch.env.items() if os.environ.get(k) != v}
    if arm == "kernels" and missing:
        raise RuntimeError(f"--arm kernels but the kernel switch is not set in the environment: {missing}")
    present = sorted(k for k in spec.kernel_switch.env if k in os.environ)
    if arm == "baseline" and present:
        raise RuntimeError(f"--arm baseline but the kernel switch variables {present} are set")


def grpo_config(spec: ABSpec, settings: TrlSettings, out: Path) -> GRPOConfig:
    """The spec's hyperparameters as TRL's config (mapping: docs/e2e-trl.md, "Spec mapping")."""
    hp = spec.hyperparameters
    return GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=settings.device == "cpu", bf16=settings.dtype == "bfloat16",
        report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1,
        seed=spec.seeds.seed, data_seed=spec.seeds.rollout_seed, max_steps=hp.num_rollout,
        learning_rate=hp.lr, lr_scheduler_type="constant", per_device_train_batch_size=hp.global_batch_size,
        num_generations=hp.n_samples_per_prompt, max_completion_length=hp.rollout_max_response_len,
        temperature=hp.rollout_temperature, epsilon=hp.eps_clip, epsilon_high=hp.eps_clip_high,
        beta=hp.kl_loss_coef if hp.use_kl_loss else 0.0, loss_type=settings.loss_type,
        entropy_coef=hp.entropy_coef, disable_dropout=True,
        **vllm_options(settings),
    )


def vllm_options(settings: TrlSettings) -> dict[str, object]:
    """TRL's vLLM integration, colocated in this process (``trl.rollout: "vllm"``); nothing otherwise."""
    if settings.rollout != "vllm":
        return {}
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": settings.vllm_gpu_memory_utilization,
            "vllm_max_model_length": settings.vllm_max_model_length, "vllm_enable_sleep_mode": False}


def run_training(spec_path: Path, arm: ArmRole, out: Path) -> None:
    """Train one arm and write metrics.jsonl + run_info.json into ``out``."""
    started = time.time()
    spec = load_spec(spec_path)
    settings = spec.settings
    assert isinstance(settings, TrlSettings), spec.engine
    check_arm_env(arm, spec)
    out.mkdir(parents=True, exist_ok=True)
    set_seed(spec.seeds.seed)
    directory = model_dir(spec, settings, out)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, settings.dtype))
    initial_digest = weights_digest(model)
    dataset = Dataset.from_list(make_prompts(settings.num_prompts, spec.seeds.rollout_seed))

    patched = arm == "kernels" and trl_integration.logp_enabled_by_env()
    if arm == "kernels" and not patched:
        raise RuntimeError("--arm kernels but VIME_RL_KERNEL / VIME_RL_KERNEL_OPS do not enable 'logp'")
    rollout: dict[str, str] = {"engine": "hf-generate"}
    if settings.rollout == "vllm":
        vllm_rollout.prepare_environment(settings.device)
        rollout = {"engine": f"vllm {vllm_rollout.versions()['vllm']}", "weight_sync": vllm_rollout.install_weight_sync()}
    kernels.reset_fallback_counts()
    callback = MetricsCallback(settings, out / METRICS_FILE)
    if patched:
        trl_integration.install()
    try:
        trainer = TimedGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[repeat_reward_func],
                                   args=grpo_config(spec, settings, out), train_dataset=dataset, callbacks=[callback])
        trainer.init_rlk(settings)
        callback.trainer = trainer
        train_start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - train_start
        if settings.rollout == "vllm":
            rollout["dtype"] = vllm_rollout.engine_dtype(trainer)
    finally:
        calls = trl_integration.call_counts()
        trl_integration.uninstall()

    info = {
        "arm": arm, "label": spec.arm_label(arm), "case": spec.case, "spec": str(spec_path),
        "kernels_installed": patched,
        "patched": f"{trl_integration.PATCH_MODULE}.{trl_integration.PATCH_NAME}" if patched else None,
        "patched_calls": calls if patched else {},
        "backend_id": kernels.backend_id(),
        "fallback_counts": kernels.fallback_counts(),
        "fallback_reasons": kernels.fallback_reasons(),
        "initial_weights_digest": initial_digest,
        "rollout": rollout,
        "model_dir": str(directory),
        "settings": settings.model_dump(),
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("VIME_RL_", "TRITON_", "RLK_", "VLLM_"))},
        "versions": {
            "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__, "kernels": kernels.__version__, "triton": _version("triton"),
            **({"vllm": vllm_rollout.versions()["vllm"]} if settings.rollout == "vllm" else {}),
        },
        "device": settings.device,
        "hardware": hardware(settings.device),
        "train_seconds": train_seconds,
        "wall_seconds": time.time() - started,
    }
    (out / RUN_INFO_FILE).write_text(json.dumps(info, indent=1, sort_keys=True))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name if __spec__ else __name__}",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, type=Path, help="A/B spec (JSON) with engine 'trl'")
    parser.add_argument("--arm", required=True, choices=["baseline", "kernels"])
    parser.add_argument("--out", required=True, type=Path, help="output directory of this arm")
    ns = parser.parse_args(argv)
    run_training(ns.spec, ns.arm, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
