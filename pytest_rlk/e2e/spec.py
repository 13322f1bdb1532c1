"""The A/B run spec: one file describes both arms of an end-to-end comparison.

Everything that must be identical between the arms (model, data, hardware, seeds,
hyperparameters, parallelism, engine settings) is written once; the only difference between the
arms is the `kernel_switch` (environment + extra engine arguments of the kernel arm). Engines turn a
spec into one `ArmCommand` per arm and lane; `check_arms_differ_only_by_switch` asserts on the
resolved commands that nothing else differs, so a builder bug cannot slip a second difference in.

Engine-specific settings live in one section named after the engine (`vime:` or `trl:`); the
other section must be absent. The `trl` section is kept as a plain mapping here and validated by
the TRL engine's own model, so this file stays engine-agnostic.

Spec files are JSON (`pytest_rlk/e2e/specs/*.json`). Paths may use `${VAR}` placeholders
(`${RLK_MODELS}`, `${RLK_DATA}`, `${MEGATRON_LM}`): `plan` prints them as written, `run` expands
them and fails naming the variable when one is unset.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SPEC_SCHEMA_VERSION = 1
SPECS_DIR = Path(__file__).with_name("specs")

EngineName = Literal["vime", "trl"]
Lane = Literal["replay", "live"]
Platform = Literal["h100", "h200", "a100", "gb200", "gpu", "cpu"]
ArmRole = Literal["baseline", "kernels"]
ARM_ROLES: tuple[ArmRole, ArmRole] = ("baseline", "kernels")

# The env switch every engine's kernel arm must set (docs/design/architecture.md, "Switches").
KERNEL_ENV_SWITCH = "VIME_RL_KERNEL"


class SpecError(ValueError):
    """A spec file or spec value is invalid; the message names the file and the field."""


class ArmMismatchError(AssertionError):
    """The two arms' resolved commands differ by more than the kernel switch (and the lane's
    declared record/replay arguments)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Frozen):
    name: str = Field(description="Hub name of the model, e.g. Qwen/Qwen3-30B-A3B (for the report).")
    hf_checkpoint: str = Field(description="HF checkpoint dir on the node (rollout + tokenizer).")
    ref_load: str | None = Field(
        default=None,
        description="Megatron torch_dist checkpoint dir; None in bridge mode (the HF dir is used).",
    )
    moe: bool = False


class DatasetSpec(_Frozen):
    name: str
    prompt_data: str = Field(description="Prompt file (jsonl/parquet) on the node.")
    input_key: str
    label_key: str
    rm_type: str = Field(description="vime --rm-type (e.g. deepscaler, math, dapo).")
    apply_chat_template: bool = True


class HardwareSpec(_Frozen):
    platform: Platform
    gpus: int = Field(ge=1, description="GPUs on the (single) node the run uses.")
    nodes: Literal[1] = Field(
        default=1,
        description="The launcher binds its Ray head to loopback, so a run is single-node.",
    )


class Seeds(_Frozen):
    seed: int
    rollout_seed: int


class Hyperparameters(_Frozen):
    num_rollout: int = Field(ge=1)
    rollout_batch_size: int = Field(ge=1)
    n_samples_per_prompt: int = Field(ge=1)
    global_batch_size: int = Field(ge=1)
    rollout_max_response_len: int = Field(ge=1)
    rollout_temperature: float = Field(default=1.0, gt=0)
    lr: float = Field(gt=0)
    eps_clip: float = Field(default=0.2, gt=0)
    eps_clip_high: float = Field(default=0.28, gt=0)
    use_kl_loss: bool = True
    kl_loss_coef: float = Field(default=0.0, ge=0)
    kl_loss_type: Literal["low_var_kl", "k1", "k2", "k3"] = "low_var_kl"
    entropy_coef: float = Field(default=0.0, ge=0)
    advantage_estimator: Literal["grpo"] = "grpo"

    @model_validator(mode="after")
    def _batch_divides(self) -> Hyperparameters:
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if samples % self.global_batch_size:
            raise ValueError(
                f"hyperparameters: rollout_batch_size * n_samples_per_prompt = {samples} is not a "
                f"multiple of global_batch_size = {self.global_batch_size}"
            )
        return self


class Parallelism(_Frozen):
    tensor: int = Field(default=1, ge=1)
    pipeline: int = Field(default=1, ge=1)
    context: int = Field(default=1, ge=1)
    expert: int = Field(default=1, ge=1)
    actor_num_gpus_per_node: int = Field(ge=1)
    rollout_num_gpus: int = Field(ge=1)
    rollout_num_gpus_per_engine: int = Field(ge=1)
    colocate: bool


class KernelSwitch(_Frozen):
    """The one difference between the arms: applied to the kernel arm only."""

    env: dict[str, str]
    args: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _sets_the_env_switch(self) -> KernelSwitch:
        if self.env.get(KERNEL_ENV_SWITCH) != "1":
            raise ValueError(f"kernel_switch.env must set {KERNEL_ENV_SWITCH}=1")
        return self


class ArmSpec(_Frozen):
    label: str = Field(description='Name in reports, e.g. "vime+R3" / "vime+R3+kernels".')


class Arms(_Frozen):
    baseline: ArmSpec
    kernels: ArmSpec

    @model_validator(mode="after")
    def _distinct(self) -> Arms:
        if self.baseline.label == self.kernels.label:
            raise ValueError(f"arms: both arms are labelled {self.baseline.label!r}")
        return self


class WindowSpec(_Frozen):
    skip_warmup_rollouts: int = Field(
        ge=0, description="Rollouts (steps) dropped from the front of every series before gating."
    )


class Timeouts(_Frozen):
    head_start_s: float = Field(default=120.0, gt=0)
    job_s: float = Field(gt=0, description="Wall-clock limit of one arm's job.")


class GateSelection(_Frozen):
    """Which metric groups gate (the rest are reported). Compatibility runs (R3) gate only
    correctness and fallbacks; speed runs also gate time and memory."""

    speed: bool = True
    memory: bool = True


class VimeSettings(_Frozen):
    """vime-specific settings, shared by both arms (facts: shared/docs/vime-facts.md)."""

    commit: str | None = Field(
        default=None, description="Pinned vime commit; checked against --rlk-vime-root's HEAD."
    )
    entry: Literal["train.py", "train_async.py"] = "train.py"
    megatron_path: str = Field(description="Megatron-LM checkout put on PYTHONPATH.")
    checkpoint_mode: Literal["bridge", "torch_dist"]
    model_args_script: str | None = Field(
        default=None,
        description="Script under the vime root defining MODEL_ARGS (sourced before train.py).",
    )
    deterministic: bool = True
    routing_replay: bool = False
    use_tensorboard: bool = True
    ci_test: bool = False
    fault_tolerance: bool = False
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _no_ci_test_with_fault_tolerance(self) -> VimeSettings:
        ci = self.ci_test or "--ci-test" in self.extra_args
        ft = self.fault_tolerance or "--use-fault-tolerance" in self.extra_args
        if ci and ft:
            raise ValueError(
                "vime: --ci-test together with --use-fault-tolerance deliberately kills an engine; "
                "never combine them in an A/B run"
            )
        return self


class ABSpec(_Frozen):
    schema_version: Literal[1] = SPEC_SCHEMA_VERSION
    case: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", description="Case id (baselines, dirs).")
    description: str
    purpose: Literal["smoke", "correctness", "speed", "compatibility", "generalization"]
    engine: EngineName
    markers: list[str] = Field(
        description='pytest markers of the case, e.g. ["vime", "h200", "gpus(8)", "qwen3_30b_a3b"].'
    )
    model: ModelSpec
    dataset: DatasetSpec
    hardware: HardwareSpec
    seeds: Seeds
    hyperparameters: Hyperparameters
    parallelism: Parallelism
    arms: Arms
    kernel_switch: KernelSwitch
    lanes: list[Lane] = Field(min_length=1)
    window: WindowSpec
    timeouts: Timeouts
    gates: GateSelection = GateSelection()
    vime: VimeSettings | None = None
    trl: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ABSpec:
        sections = {"vime": self.vime, "trl": self.trl}
        if sections[self.engine] is None:
            raise ValueError(f"engine is {self.engine!r} but the {self.engine!r} section is missing")
        for other, value in sections.items():
            if other != self.engine and value is not None:
                raise ValueError(f"engine is {self.engine!r}: remove the {other!r} section")
        if len(set(self.lanes)) != len(self.lanes):
            raise ValueError(f"lanes: duplicates in {self.lanes}")
        if self.window.skip_warmup_rollouts >= self.hyperparameters.num_rollout:
            raise ValueError(
                f"window.skip_warmup_rollouts = {self.window.skip_warmup_rollouts} leaves no "
                f"rollout of hyperparameters.num_rollout = {self.hyperparameters.num_rollout}"
            )
        if self.engine == "vime":
            self._check_vime_resources()
        return self

    def _check_vime_resources(self) -> None:
        par, hw = self.parallelism, self.hardware
        actor_gpus = par.actor_num_gpus_per_node * hw.nodes
        used = actor_gpus if par.colocate else actor_gpus + par.rollout_num_gpus
        if par.colocate and par.rollout_num_gpus != actor_gpus:
            raise ValueError(
                f"parallelism: colocated runs share GPUs, so rollout_num_gpus "
                f"({par.rollout_num_gpus}) must equal the actor GPUs ({actor_gpus})"
            )
        if used != hw.gpus:
            raise ValueError(f"parallelism uses {used} GPUs but hardware.gpus = {hw.gpus}")
        model_parallel = par.tensor * par.pipeline * par.context
        if actor_gpus % model_parallel:
            raise ValueError(
                f"parallelism: tensor*pipeline*context = {model_parallel} does not divide the "
                f"{actor_gpus} actor GPUs"
            )
        if par.rollout_num_gpus % par.rollout_num_gpus_per_engine:
            raise ValueError(
                "parallelism: rollout_num_gpus_per_engine does not divide rollout_num_gpus"
            )
        if par.expert > 1 and not self.model.moe:
            raise ValueError("parallelism.expert > 1 needs a MoE model (model.moe = true)")
        if self.vime is not None and self.vime.routing_replay and not self.model.moe:
            raise ValueError("vime.routing_replay (R3) needs a MoE model (model.moe = true)")
        if self.vime is not None and self.vime.checkpoint_mode == "torch_dist" and not self.model.ref_load:
            raise ValueError("vime.checkpoint_mode = torch_dist needs model.ref_load")

    def arm_label(self, role: ArmRole) -> str:
        return getattr(self.arms, role).label


def load_spec(path: str | Path) -> ABSpec:
    """Load and validate a spec file; errors name the file and the offending field."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise SpecError(f"{path}: spec file not found") from exc
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}: not valid JSON: {exc}") from exc
    try:
        return ABSpec.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<spec>'}: {err['msg']}" for err in exc.errors()
        )
        raise SpecError(f"{path}: invalid A/B spec: {problems}") from exc


def matrix_spec_paths() -> list[Path]:
    """The benchmark-matrix specs shipped with the suite."""
    return sorted(SPECS_DIR.glob("*.json"))


def resolve_spec_name(name_or_path: str) -> Path:
    """A path to a spec file, or the case name of a shipped spec (`qwen3-30b-a3b-h200-grpo`)."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return path
    shipped = SPECS_DIR / f"{name_or_path}.json"
    if shipped.exists():
        return shipped
    known = ", ".join(p.stem for p in matrix_spec_paths())
    raise SpecError(f"{name_or_path!r}: no such spec file and no shipped spec of that name ({known})")


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_placeholders(text: str, env: dict[str, str] | None = None, *, what: str) -> str:
    """Expand `${VAR}` from env (default os.environ); an unset variable is an error naming it."""
    env = os.environ if env is None else env

    def _sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise SpecError(f"{what}: {text!r} uses ${{{name}}} but {name} is not set")
        return env[name]

    return _VAR.sub(_sub, text)


# --------------------------------------------------------------------------------------------
# Resolved commands and the "arms differ only by the switch" check (engine-agnostic).
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmCommand:
    """One arm's job, fully resolved: what is executed and with which environment.

    `lane_args` are the lane's declared per-arm arguments (record vs replay paths), contiguous in
    `argv`; `output_env` holds per-arm output locations (e.g. `TENSORBOARD_DIR`), same keys in
    both arms. The identical-arms check removes both (and the kernel switch) and requires the
    rest to be equal. The process environment is `env | output_env`.
    """

    role: ArmRole
    label: str
    lane: Lane
    argv: list[str]
    env: dict[str, str]
    lane_args: list[str] = field(default_factory=list)
    output_env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None

    @property
    def full_env(self) -> dict[str, str]:
        return {**self.env, **self.output_env}


def _remove_run(argv: list[str], run: list[str], *, what: str) -> list[str]:
    if not run:
        return list(argv)
    for i in range(len(argv) - len(run) + 1):
        if argv[i : i + len(run)] == run:
            return argv[:i] + argv[i + len(run) :]
    raise ArmMismatchError(f"{what} {run} not found in the command {argv}")


def _group_options(argv: list[str]) -> list[tuple[str, ...]]:
    """Split argv into option groups (`--flag v1 v2`), so a mismatch names the flag."""
    groups: list[list[str]] = []
    for token in argv:
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return [tuple(g) for g in groups]


def check_arms_differ_only_by_switch(
    baseline: ArmCommand, kernels: ArmCommand, switch: KernelSwitch
) -> None:
    """Raise ArmMismatchError naming every difference other than the kernel switch.

    The baseline must not carry any part of the switch; the kernel arm must carry all of it.
    """
    if (baseline.role, kernels.role) != ARM_ROLES:
        raise ArmMismatchError(f"expected roles {ARM_ROLES}, got {(baseline.role, kernels.role)}")
    if baseline.lane != kernels.lane:
        raise ArmMismatchError(f"arms are on different lanes: {baseline.lane} vs {kernels.lane}")
    problems: list[str] = []
    for key, value in switch.env.items():
        if key in baseline.env:
            problems.append(f"baseline env sets the kernel switch {key}={baseline.env[key]}")
        if kernels.env.get(key) != value:
            problems.append(f"kernel arm env lacks {key}={value}")
    base_env = {k: v for k, v in baseline.env.items() if k not in switch.env}
    kern_env = {k: v for k, v in kernels.env.items() if k not in switch.env}
    for key in sorted(set(base_env) | set(kern_env)):
        if base_env.get(key) != kern_env.get(key):
            problems.append(f"env {key}: {base_env.get(key)!r} vs {kern_env.get(key)!r}")
    for flag in switch.args:
        if flag.startswith("--") and flag in baseline.argv:
            problems.append(f"baseline command carries the kernel switch argument {flag}")
    base_argv = _remove_run(baseline.argv, baseline.lane_args, what="baseline lane args")
    kern_argv = _remove_run(kernels.argv, kernels.lane_args, what="kernel arm lane args")
    kern_argv = _remove_run(kern_argv, list(switch.args), what="kernel switch args")
    base_groups, kern_groups = _group_options(base_argv), _group_options(kern_argv)
    if base_groups != kern_groups:
        only_base = [" ".join(g) for g in base_groups if g not in kern_groups]
        only_kern = [" ".join(g) for g in kern_groups if g not in base_groups]
        if only_base or only_kern:
            problems.append(f"arguments only in baseline: {only_base}; only in kernel arm: {only_kern}")
        else:
            problems.append("the same arguments in a different order")
    if set(baseline.output_env) != set(kernels.output_env):
        problems.append(f"output env keys: {sorted(baseline.output_env)} vs {sorted(kernels.output_env)}")
    if baseline.workdir != kernels.workdir:
        problems.append(f"workdir: {baseline.workdir!r} vs {kernels.workdir!r}")
    if problems:
        raise ArmMismatchError(
            f"arms {baseline.label!r} and {kernels.label!r} ({baseline.lane} lane) differ beyond "
            "the kernel switch: " + "; ".join(problems)
        )
