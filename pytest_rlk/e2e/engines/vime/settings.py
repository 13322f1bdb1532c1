"""The spec's `vime` section: vime settings shared by both arms (facts: shared/docs/vime-facts.md),
and its checks against the rest of the spec (GPUs, parallelism, MoE-only features)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pytest_rlk.e2e.spec import ABSpec, EngineSettings

# Both arms install our loss through vime's hooks; the kernel switch (environment) decides whether
# the kernels or vime's own policy_loss_function compute it. A kernel switch may not change the loss
# path: vime's actor decides its forwards from --loss-type (an extra old-log-prob forward with
# custom_loss), so the arms would do different work.
LOSS_HOOK_ARGS = (
    "--loss-type", "custom_loss",
    "--custom-loss-function-path", "kernels.integrations.vime.policy_loss",
    "--custom-megatron-init-path", "kernels.integrations.vime.init_hook",
)
LOSS_PATH_FLAGS = frozenset({"--loss-type", "--custom-loss-function-path", "--custom-megatron-init-path"})
# The fork's provider flags. Its loss_function hands the provider's context (hidden states, LM head)
# only to --loss-type policy_loss and sft_loss: under custom_loss (both arms) every call our loss hands
# to vime's loss consults the provider without one, which logs "unavailable" (a fallback line) and
# serves nothing. The combination is refused; our custom loss computes the kernel arm's log-probs.
PROVIDER_FLAGS = frozenset({"--linear-logp-provider", "--linear-logp-provider-mode"})


class VimeSettings(EngineSettings):
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

    def check_spec(self, spec: ABSpec) -> None:
        switched = sorted({a.split("=", 1)[0] for a in spec.kernel_switch.args} & LOSS_PATH_FLAGS)
        if switched:
            raise ValueError(
                f"kernel_switch.args sets {switched}: both vime arms install the loss hook (the engine adds "
                f"{' '.join(LOSS_HOOK_ARGS)}); the kernel switch is the environment (VIME_RL_KERNEL=1)"
            )
        for where, args in (("vime.extra_args", self.extra_args), ("kernel_switch.args", spec.kernel_switch.args)):
            provider = sorted({a.split("=", 1)[0] for a in args} & PROVIDER_FLAGS)
            if provider:
                raise ValueError(
                    f"{where} sets {provider}, but both vime arms run --loss-type custom_loss (our loss, which "
                    "computes the log-probs itself): the fork's loss_function passes the linear_logp provider "
                    "its context only under --loss-type policy_loss or sft_loss, so every call our loss hands "
                    "to vime's native loss would consult the provider without one and log 'linear_logp "
                    "provider ... is unavailable' (counted as a kernel fallback). Remove the provider flags "
                    "from the spec"
                )
        par, hw = spec.parallelism, spec.hardware
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
            raise ValueError("parallelism: rollout_num_gpus_per_engine does not divide rollout_num_gpus")
        if par.expert > 1 and not spec.model.moe:
            raise ValueError("parallelism.expert > 1 needs a MoE model (model.moe = true)")
        if self.routing_replay and not spec.model.moe:
            raise ValueError("vime.routing_replay (R3) needs a MoE model (model.moe = true)")
        if self.checkpoint_mode == "torch_dist" and not spec.model.ref_load:
            raise ValueError("vime.checkpoint_mode = torch_dist needs model.ref_load")
