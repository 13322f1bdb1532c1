"""One arm of a TRL A/B: a real TRL ``GRPOTrainer`` run, in the arm's own process.

    python -m pytest_rlk.e2e.engines.trl.child --spec SPEC.json --arm baseline|kernels --out DIR
        [--model-dir DIR] [--record-rollouts FILE | --replay-rollouts FILE]

Both arms load the same model: a tiny real Qwen3 (``tiny_models``, seeded random init) with the
spec's supervised warm start (``warm_start``) applied, built once per A/B run into ``--model-dir``
by whichever arm comes first (under a file lock) and loaded from disk by every arm, so the arms'
weights are identical (checked by a weight digest in ``run_info.json``). They train on the same
synthetic task (``task``) with identical seeds and settings. The kernel arm differs only by the
spec's kernel switch environment; with it, ``kernels.integrations.trl`` routes TRL's per-token
log-probs through ``kernels.linear_logp`` or ``kernels.logp``, and, where the switch admits
``ratio_kl``, the loss through ``grpo_policy_loss``. Responses come from the transformers sampler
with its own log-probs (``rollout.SamplerRollout``), recorded by the replay lane's baseline arm
and replayed by its kernel arm; with ``trl.rollout: "vllm"`` a colocated vLLM engine samples them
(``vllm_rollout``).
Writes ``DIR/metrics.jsonl`` (``trainer.MetricsCallback``) and ``DIR/run_info.json`` (versions,
backend id, fallback counts and reasons, patched-call counts, settings, environment).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
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
from pytest_rlk.e2e.engines.trl.rollout import SamplerRollout
from pytest_rlk.e2e.engines.trl.series import METRICS_FILE, RUN_INFO_FILE
from pytest_rlk.e2e.engines.trl.settings import TINY_PREFIX, TrlSettings
from pytest_rlk.e2e.engines.trl.trainer import MetricsCallback, TimedGRPOTrainer, hardware
from pytest_rlk.e2e.engines.trl.warm_start import WarmStart, run_warm_start

WARM_START_RECORD = "rlk_warm_start.json"
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


def warm_start_plan(settings: TrlSettings) -> WarmStart:
    return WarmStart(steps=settings.warm_start_steps, correct_fraction=settings.warm_start_correct_fraction,
                     distractor_fraction=settings.warm_start_distractor_fraction, lr=settings.warm_start_lr)


@contextlib.contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (arms that run at the same time build one model)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def model_dir(spec: ABSpec, settings: TrlSettings, target: Path) -> Path:
    """The checkpoint every arm loads: the spec's local one, or a tiny random-init model, with the
    spec's warm start applied; built into ``target`` by the first arm to come, loaded by the rest."""
    local = local_checkpoint(spec)
    plan = warm_start_plan(settings)
    if local is not None and plan.steps == 0:
        return local
    with exclusive(target.with_name(target.name + ".lock")):
        if (target / WARM_START_RECORD).is_file():
            built = json.loads((target / WARM_START_RECORD).read_text()).get("seed")
            if built is not None and built != spec.seeds.seed:
                raise ValueError(f"{target}: built with seeds.seed = {built}, this arm's is {spec.seeds.seed}: "
                                 "arms that share a model directory share its seed (vary seeds.rollout_seed)")
            return target
        building = target.with_name(target.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        if local is None:
            size = TinyModelSize.from_dict(dict(settings.model_size))
            kind = spec.model.hf_checkpoint[len(TINY_PREFIX):]
            source = build_tiny_model_dir(building / "init", kind, size, seed=spec.seeds.seed,
                                          extra_vocab=settings.extra_vocab)
        else:
            source = local
        record: dict[str, object] = {"source": str(source), "steps": plan.steps, "seed": spec.seeds.seed}
        if plan.steps:
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, settings.dtype))
            model.to(settings.device)
            set_seed(spec.seeds.seed)
            started = time.perf_counter()
            losses = run_warm_start(model, tokenizer, plan, spec.seeds.seed)
            record.update(losses=losses, seconds=time.perf_counter() - started, start_reward=plan.start_reward(),
                          correct_fraction=plan.correct_fraction, distractor_fraction=plan.distractor_fraction,
                          lr=plan.lr)
            model.save_pretrained(building / "final")
            tokenizer.save_pretrained(building / "final")
            final = building / "final"
        else:
            final = source
        (final / WARM_START_RECORD).write_text(json.dumps(record, indent=1))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(final, target)
        shutil.rmtree(building, ignore_errors=True)
    return target


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


def run_training(spec_path: Path, arm: ArmRole, out: Path, *, model_root: Path | None = None,
                 record_rollouts: Path | None = None, replay_rollouts: Path | None = None) -> None:
    """Train one arm and write metrics.jsonl + run_info.json into ``out``."""
    started = time.time()
    spec = load_spec(spec_path)
    settings = spec.settings
    assert isinstance(settings, TrlSettings), spec.engine
    check_arm_env(arm, spec)
    out.mkdir(parents=True, exist_ok=True)
    directory = model_dir(spec, settings, model_root or out / "model")
    set_seed(spec.seeds.seed)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, settings.dtype))
    initial_digest = weights_digest(model)
    dataset = Dataset.from_list(make_prompts(settings.num_prompts, spec.seeds.rollout_seed))

    patched = arm == "kernels" and trl_integration.logp_enabled_by_env()
    if arm == "kernels" and not patched:
        raise RuntimeError("--arm kernels but VIME_RL_KERNEL / VIME_RL_KERNEL_OPS enable neither 'logp' nor "
                           "'linear_logp'")
    kernel_loss = arm == "kernels" and trl_integration.loss_enabled_by_env()
    rollout: dict[str, str] = {"engine": "hf-generate (KV-cache decode, the sampler's own log-probs)",
                               "weight_sync": "none: the sampler is the trained model, in-process"}
    sampler = None
    if settings.rollout == "hf":
        sampler = SamplerRollout(record_to=record_rollouts, replay_from=replay_rollouts)
        if replay_rollouts is not None:
            rollout["replayed_from"] = str(replay_rollouts)
    elif record_rollouts or replay_rollouts:
        raise ValueError("--record-rollouts / --replay-rollouts need trl.rollout 'hf'")
    if settings.rollout == "vllm":
        vllm_rollout.prepare_environment(settings.device)
        rollout = {"engine": f"vllm {vllm_rollout.versions()['vllm']}", "weight_sync": vllm_rollout.install_weight_sync()}
    kernels.reset_fallback_counts()
    callback = MetricsCallback(settings, out / METRICS_FILE)
    if patched:
        trl_integration.install(entropy_grad=spec.hyperparameters.entropy_coef != 0.0)
    try:
        if sampler is not None:
            os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's documented seam
        trainer = TimedGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[repeat_reward_func],
                                   args=grpo_config(spec, settings, out), train_dataset=dataset, callbacks=[callback],
                                   rollout_func=sampler)
        trainer.init_rlk(settings, kernel_loss=kernel_loss)
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
        "kernel_ops": sorted({"lm_head_logp": "logp"}.get(op, op) for op, n in calls.items() if op != "tokens" and n)
        if patched else [],
        "kernel_loss": kernel_loss,
        "warm_start": json.loads((directory / WARM_START_RECORD).read_text())
        if (directory / WARM_START_RECORD).is_file() else None,
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
    parser.add_argument("--model-dir", type=Path, help="where the arms' shared (warm-started) model is built once")
    lane = parser.add_mutually_exclusive_group()
    lane.add_argument("--record-rollouts", type=Path, help="record every step's sampled rollouts here (JSON lines)")
    lane.add_argument("--replay-rollouts", type=Path, help="train on these recorded rollouts instead of sampling")
    ns = parser.parse_args(argv)
    run_training(ns.spec, ns.arm, ns.out, model_root=ns.model_dir, record_rollouts=ns.record_rollouts,
                 replay_rollouts=ns.replay_rollouts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
