"""The A/B run spec: one file describes both arms of an end-to-end comparison.

Everything that must be identical between the arms (model, data, hardware, seeds,
hyperparameters, parallelism, engine settings) is written once; the arms differ only by the
`kernel_switch` (environment + extra engine arguments of the kernel arm) and what an arm declares
in `arms.<role>.env` (a test variant; plans and reports show it). `arms` checks the commands.

Engine settings live in one section named after the engine (`"engine": "trl"`, `"trl": {...}`),
validated by the engine's own model (`Engine.settings_model`, an `EngineSettings`), so `load_spec`
errors name the file and the field (`trl.dtype: ...`). In Python it is `spec.settings`; dumps write
it back under the engine's name.

Spec files are JSON (`pytest_rlk/e2e/specs/*.json`). Paths may use `${VAR}` placeholders
(`pytest_rlk.e2e.placeholders`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, SerializeAsAny, SerializerFunctionWrapHandler, ValidationError,
    ValidatorFunctionWrapHandler, model_serializer, model_validator,
)
from pydantic_core import PydanticCustomError

from pytest_rlk.schema import Band

SPEC_SCHEMA_VERSION = 1
SPECS_DIR = Path(__file__).with_name("specs")

Lane = Literal["replay", "live"]
Platform = Literal["h100", "h200", "a100", "gb200", "gpu", "cpu"]
ArmRole = Literal["baseline", "kernels"]
ARM_ROLES: tuple[ArmRole, ArmRole] = ("baseline", "kernels")

# The env switch every engine's kernel arm must set (docs/design/architecture.md, "Switches").
KERNEL_ENV_SWITCH = "VIME_RL_KERNEL"


class SpecError(ValueError):
    """A spec file or spec value is invalid; the message names the file and the field."""


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
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of this arm only, beyond the kernel switch (a test or diagnostic variant: "
        "e.g. a kernel backend chosen for the kernel arm). A declared difference: plans and reports show it.",
    )


class Arms(_Frozen):
    baseline: ArmSpec
    kernels: ArmSpec

    @model_validator(mode="after")
    def _distinct(self) -> Arms:
        if self.baseline.label == self.kernels.label:
            raise ValueError(f"arms: both arms are labelled {self.baseline.label!r}")
        return self


class ReplayHorizon(_Frozen):
    """The steps the replay lane compares one by one: 0 .. steps-1.

    Both arms of the replay lane train on the same rollouts, but each on its own weights. A correct
    kernel differs from the baseline in its last bits, and training amplifies that difference step
    after step (fast at a high learning rate), until the replayed rollouts are off-policy for one
    arm and the per-step comparison measures chaos, not the kernel. Past the horizon the series are
    reported and charted, not gated."""

    steps: int = Field(ge=1, description="Steps compared one by one (from step 0).")
    source: str = Field(min_length=1, description="The measurement the horizon comes from: how far a "
                        "correct kernel's per-step differences stay inside their bands on this case's platform.")


class WindowSpec(_Frozen):
    skip_warmup_rollouts: int = Field(
        ge=0, description="Rollouts (steps) dropped from the front of every series before gating."
    )
    replay_horizon: ReplayHorizon | None = Field(
        default=None, description="The replay lane compares steps 0 .. steps-1 only (unset: every step).")


class Timeouts(_Frozen):
    head_start_s: float = Field(default=120.0, gt=0)
    job_s: float = Field(gt=0, description="Wall-clock limit of one arm's job.")


class GateSelection(_Frozen):
    """Which metric groups gate (the rest are reported). Compatibility runs (R3) gate only
    correctness and fallbacks; speed runs also gate time and memory."""

    speed: bool = True
    memory: bool = True


class EngineSettings(_Frozen):
    """Base of every engine's settings section (the spec's `<engine>` object)."""

    def check_spec(self, spec: ABSpec) -> None:
        """Cross-checks of the section against the rest of the spec; raise ValueError naming the
        fields. The default checks nothing."""


def _error(loc: tuple[str, ...], message: str, value: Any) -> dict[str, Any]:
    return {"type": "engine_section", "loc": loc, "msg": message, "input": value}


class ABSpec(_Frozen):
    schema_version: Literal[1] = SPEC_SCHEMA_VERSION
    case: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", description="Case id (baselines, dirs).")
    description: str
    purpose: Literal["smoke", "correctness", "speed", "compatibility", "generalization"]
    engine: str = Field(description="Engine name: a package under pytest_rlk/e2e/engines/ (vime, trl, ...).")
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
    bands: dict[str, Band] = Field(
        default_factory=dict,
        description='Band overrides of this case, "<lane>.<metric>" -> band (e.g. "replay.loss"), each with its '
        "source: measured noise of the case (A/A reruns on its platform) in place of the metric's default band.")
    settings: SerializeAsAny[EngineSettings] = Field(description="The engine's section, validated by its own model.")

    @model_validator(mode="wrap")
    @classmethod
    def _engine_section(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> ABSpec:
        """Validate the `<engine>` section with the engine's model; its errors and the rest's are
        reported together, located under the section's name (`trl.dtype`)."""
        if not isinstance(data, dict) or not isinstance(data.get("engine"), str) or "settings" in data:
            return handler(data)
        from pytest_rlk.e2e.engines import UnknownEngineError, engine_names, get_engine

        data = dict(data)
        engine = data["engine"]
        errors: list[dict[str, Any]] = []
        settings = EngineSettings()  # stands in for an invalid section: the rest is still validated
        for other in engine_names():
            if other != engine and other in data:
                errors.append(_error((other,), f"engine is {engine!r}: remove the {other!r} section", data.pop(other)))
        try:
            model = get_engine(engine).settings_model
        except UnknownEngineError as exc:
            errors.append(_error(("engine",), str(exc), engine))
        else:
            section = data.pop(engine, None)
            if section is None:
                errors.append(_error((engine,), f"engine is {engine!r} but the {engine!r} section is missing", None))
            else:
                try:
                    settings = model.model_validate(section)
                except ValidationError as exc:
                    errors += [{**err, "loc": (engine, *err["loc"])} for err in exc.errors()]
        data["settings"] = settings
        try:
            spec = handler(data)
        except ValidationError as exc:
            errors = exc.errors() + errors
        if errors:
            raise ValidationError.from_exception_data(
                cls.__name__, [{"type": PydanticCustomError(e["type"], e["msg"]), "loc": e["loc"], "input": e["input"]}
                               for e in errors])
        return spec

    @model_serializer(mode="wrap")
    def _dump_section_under_engine(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        settings = data.pop("settings", None)
        if settings is not None:
            data[self.engine] = settings
        return data

    def band_for(self, lane: Lane, metric: str) -> Band | None:
        """The spec's band for ``metric`` in ``lane``, or None (the metric's default applies)."""
        return self.bands.get(f"{lane}.{metric}")

    @model_validator(mode="after")
    def _consistent(self) -> ABSpec:
        if len(set(self.lanes)) != len(self.lanes):
            raise ValueError(f"lanes: duplicates in {self.lanes}")
        from pytest_rlk.e2e.metrics import E2E_METRICS

        for key, band in self.bands.items():
            lane, _, metric = key.partition(".")
            if lane not in self.lanes or metric not in E2E_METRICS:
                raise ValueError(f"bands: {key!r} is not '<lane>.<metric>' with a lane of {self.lanes} and a metric "
                                 f"of pytest_rlk.e2e.metrics")
            if not band.source:
                raise ValueError(f"bands: {key!r} needs its source (the measurement it comes from)")
        horizon = self.window.replay_horizon
        if horizon is not None and ("replay" not in self.lanes or horizon.steps > self.hyperparameters.num_rollout):
            raise ValueError(
                f"window.replay_horizon.steps = {horizon.steps} needs the replay lane (lanes: {self.lanes}) and "
                f"at most hyperparameters.num_rollout = {self.hyperparameters.num_rollout} steps")
        if self.window.skip_warmup_rollouts >= self.hyperparameters.num_rollout:
            raise ValueError(
                f"window.skip_warmup_rollouts = {self.window.skip_warmup_rollouts} leaves no "
                f"rollout of hyperparameters.num_rollout = {self.hyperparameters.num_rollout}"
            )
        if type(self.settings) is not EngineSettings:  # the base stands in only while errors are gathered
            self.settings.check_spec(self)
        for role in ARM_ROLES:
            clash = sorted(set(getattr(self.arms, role).env) & set(self.kernel_switch.env))
            if clash:
                raise ValueError(f"arms.{role}.env sets kernel switch variables {clash}: the switch is kernel_switch.env")
        return self

    def arm_label(self, role: ArmRole) -> str:
        return getattr(self.arms, role).label

    def arm_variant(self, role: ArmRole, note: str, *, env: dict[str, str] | None = None,
                    rollout_seed_offset: int = 0, num_rollout: int | None = None) -> ABSpec:
        """This spec for an extra arm (`ExtraArm`): the `role` arm labelled "<label> (<note>)", with
        `env` as its declared environment (None: its own), its rollout seed moved by
        `rollout_seed_offset`, and `num_rollout` rollouts (None: the spec's)."""
        raw = self.model_dump(mode="json")
        arm = raw["arms"][role]
        raw["arms"][role] = {**arm, "label": f"{arm['label']} ({note})", **({} if env is None else {"env": env})}
        raw["seeds"]["rollout_seed"] += rollout_seed_offset
        if num_rollout is not None:
            raw["hyperparameters"]["num_rollout"] = num_rollout
        return ABSpec.model_validate(raw)


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
