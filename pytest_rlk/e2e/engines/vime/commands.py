"""vime engine: turns an A/B spec into the two arms' exact `train.py` commands for a lane.

Flags follow vime-facts.md ("Launching a run", "Record/replay", "Kernel switches"); a few
standard ones come from Megatron (`--tensor-model-parallel-size` ...) and from vime's scripts
(`--rollout-max-response-len`, `--apply-chat-template`, `--entropy-coef`, `--lr`). Names moved
between vime commits: pin `vime.commit` in the spec and check `rlk e2e plan` against it.

Both arms get the same argv and env, the loss hook included (`LOSS_HOOK_ARGS`: `--loss-type
custom_loss` with our adapter and its init hook), so both run vime's `loss_function` the same way and
the same forwards (with `custom_loss` vime's actor runs its old-log-prob forward in both); the kernel
arm additionally gets `spec.kernel_switch` (the environment: `VIME_RL_KERNEL=1`). With the kernels off
the adapter hands every call to vime's own `policy_loss_function`.
Lanes:
- live: both arms run the full loop (vLLM rollouts + training);
- replay: the baseline records its rollouts (`--save-debug-rollout-data DIR/rollout_{rollout_id}.pt`),
  the kernel arm replays them train-only (`--load-debug-rollout-data` with the same path), so it
  trains on exactly the baseline's samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pytest_rlk.e2e.arms import ArmCommand
from pytest_rlk.e2e.engines.vime.settings import LOSS_HOOK_ARGS, VimeSettings
from pytest_rlk.e2e.placeholders import RUN_DIR_PLACEHOLDER
from pytest_rlk.e2e.processes import pythonpath_first
from pytest_rlk.e2e.spec import ABSpec, ArmRole, Lane, SpecError

# What `plan` prints where no --vime-root was given.
VIME_ROOT_PLACEHOLDER = "${VIME_ROOT}"
SUITE_ROOT = str(Path(__file__).resolve().parents[4])
DETERMINISM_ENV = {
    "NCCL_ALGO": "Ring",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
# Flags the spec's structured fields generate: `vime.extra_args` must not repeat them.
_GENERATED_FLAGS = frozenset({
    "--hf-checkpoint", "--ref-load", "--megatron-to-hf-mode", "--prompt-data", "--input-key",
    "--label-key", "--apply-chat-template", "--rm-type", "--num-rollout", "--rollout-batch-size",
    "--n-samples-per-prompt", "--global-batch-size", "--rollout-max-response-len",
    "--rollout-temperature", "--advantage-estimator", "--eps-clip", "--eps-clip-high", "--use-kl-loss",
    "--kl-loss-coef", "--kl-loss-type", "--entropy-coef", "--lr", "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size", "--context-parallel-size", "--expert-model-parallel-size",
    "--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus",
    "--rollout-num-gpus-per-engine", "--colocate", "--seed", "--rollout-seed", "--deterministic-mode",
    "--vllm-enable-deterministic-inference", "--use-rollout-routing-replay", "--use-tensorboard",
    "--ci-test", "--use-fault-tolerance", "--save-debug-rollout-data", "--load-debug-rollout-data",
    "--loss-type", "--custom-loss-function-path", "--custom-megatron-init-path",
})


def _settings(spec: ABSpec) -> VimeSettings:
    if not isinstance(spec.settings, VimeSettings):
        raise SpecError(f"{spec.case}: engine is {spec.engine!r}, not vime")
    return spec.settings


def shared_train_args(spec: ABSpec) -> list[str]:
    """The train.py arguments both arms share (everything but the switch and the lane args)."""
    vime = _settings(spec)
    clash = sorted({a for a in vime.extra_args if a.split("=", 1)[0] in _GENERATED_FLAGS})
    if clash:
        raise SpecError(f"{spec.case}: vime.extra_args repeats flags the spec generates: {clash}")
    model, data, hp, par = spec.model, spec.dataset, spec.hyperparameters, spec.parallelism
    args = ["--hf-checkpoint", model.hf_checkpoint]
    if vime.checkpoint_mode == "bridge":
        # the HF checkpoint is loaded as is (vime's Megatron bridge); `--megatron-to-hf-mode` is not a
        # flag at the pinned commits, so none is passed
        args += ["--ref-load", model.hf_checkpoint]
    else:
        assert model.ref_load is not None  # ABSpec validation guarantees it
        args += ["--ref-load", model.ref_load]
    args += ["--prompt-data", data.prompt_data, "--input-key", data.input_key, "--label-key", data.label_key]
    if data.apply_chat_template:
        args.append("--apply-chat-template")
    args += ["--rm-type", data.rm_type]
    args += [
        "--num-rollout", str(hp.num_rollout), "--rollout-batch-size", str(hp.rollout_batch_size),
        "--n-samples-per-prompt", str(hp.n_samples_per_prompt), "--global-batch-size", str(hp.global_batch_size),
        "--rollout-max-response-len", str(hp.rollout_max_response_len),
        "--rollout-temperature", repr(hp.rollout_temperature),
        "--advantage-estimator", hp.advantage_estimator,
        "--eps-clip", repr(hp.eps_clip), "--eps-clip-high", repr(hp.eps_clip_high),
    ]
    if hp.use_kl_loss:
        args += ["--use-kl-loss", "--kl-loss-coef", repr(hp.kl_loss_coef), "--kl-loss-type", hp.kl_loss_type]
    args += ["--entropy-coef", repr(hp.entropy_coef), "--lr", repr(hp.lr)]
    args += [
        "--tensor-model-parallel-size", str(par.tensor), "--pipeline-model-parallel-size", str(par.pipeline),
        "--context-parallel-size", str(par.context), "--expert-model-parallel-size", str(par.expert),
        "--actor-num-nodes", str(spec.hardware.nodes), "--actor-num-gpus-per-node", str(par.actor_num_gpus_per_node),
        "--rollout-num-gpus", str(par.rollout_num_gpus), "--rollout-num-gpus-per-engine", str(par.rollout_num_gpus_per_engine),
    ]
    if par.colocate:
        args.append("--colocate")
    args += ["--seed", str(spec.seeds.seed), "--rollout-seed", str(spec.seeds.rollout_seed)]
    if vime.deterministic:
        args += ["--deterministic-mode", "--vllm-enable-deterministic-inference"]
    if vime.routing_replay:
        args.append("--use-rollout-routing-replay")
    if vime.use_tensorboard:
        args.append("--use-tensorboard")
    if vime.ci_test:
        args.append("--ci-test")
    if vime.fault_tolerance:
        args.append("--use-fault-tolerance")
    return args + list(LOSS_HOOK_ARGS) + list(vime.extra_args)


def shared_env(spec: ABSpec, *, vime_root: str, suite_root: str) -> dict[str, str]:
    vime = _settings(spec)
    env = {
        # vime, Megatron-LM, and this suite (for kernels.integrations.vime) in the Ray workers.
        "PYTHONPATH": pythonpath_first(vime_root, vime.megatron_path, suite_root),
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    if vime.deterministic:
        env.update(DETERMINISM_ENV)
    if vime.routing_replay:
        env["ENABLE_ROUTING_REPLAY"] = "1"
    clash = sorted(set(vime.env) & (set(env) | set(spec.kernel_switch.env)))
    if clash:
        raise SpecError(f"{spec.case}: vime.env sets variables the suite controls: {clash}")
    return {**env, **vime.env}


def arm_commands(spec: ABSpec, lane: Lane, *, vime_root: str = VIME_ROOT_PLACEHOLDER,
                 suite_root: str = SUITE_ROOT, run_dir: str = RUN_DIR_PLACEHOLDER,
                 dirs: Mapping[ArmRole, str] | None = None, python: str = "python3",
                 entry: str | None = None) -> tuple[ArmCommand, ArmCommand]:
    """(baseline, kernels) for `lane`; each arm writes under its `dirs[role]` (default
    RUN_DIR/lane/role). `entry` overrides the script (tests pass the stand-in)."""
    vime = _settings(spec)
    if lane not in spec.lanes:
        raise SpecError(f"{spec.case}: lane {lane!r} is not in the spec's lanes {spec.lanes}")
    dirs = dirs or {role: f"{run_dir}/{lane}/{role}" for role in ("baseline", "kernels")}
    script = entry or vime.entry
    prefix = [python, script]
    if vime.model_args_script:
        # vime's scripts define the architecture flags in a bash array MODEL_ARGS.
        prefix = ["bash", "-c", 'source "$0" && exec "$@" "${MODEL_ARGS[@]}"',
                  f"{vime_root}/{vime.model_args_script}", *prefix]
    args = shared_train_args(spec)
    env = shared_env(spec, vime_root=vime_root, suite_root=suite_root)
    record_path = f"{run_dir}/{lane}/rollouts/rollout_{{rollout_id}}.pt"
    lane_args = {
        "baseline": ["--save-debug-rollout-data", record_path] if lane == "replay" else [],
        "kernels": ["--load-debug-rollout-data", record_path] if lane == "replay" else [],
    }
    commands = []
    for role in ("baseline", "kernels"):
        switch_args = list(spec.kernel_switch.args) if role == "kernels" else []
        switch_env = dict(spec.kernel_switch.env) if role == "kernels" else {}
        output_env = {"TENSORBOARD_DIR": f"{dirs[role]}/tensorboard"} if vime.use_tensorboard else {}
        commands.append(ArmCommand(
            role=role, label=spec.arm_label(role), lane=lane,
            argv=[*prefix, *args, *lane_args[role], *switch_args],
            env={**env, **switch_env}, lane_args=lane_args[role], output_env=output_env, workdir=vime_root,
            arm_env=dict(getattr(spec.arms, role).env),
        ))
    return commands[0], commands[1]
