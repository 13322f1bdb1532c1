"""The TRL engine: each arm is one subprocess of this checkout running TRL's `GRPOTrainer` on a
tiny real Qwen3 (`child`), read back from the files it writes (`series`). docs/e2e-trl.md.

Both arms build the same model from the same seed, train on the same synthetic task with the same
settings; the kernel arm differs only by the spec's kernel switch (`VIME_RL_KERNEL=1 ...`), with
which `kernels.integrations.trl` routes TRL's per-token log-probs through `kernels.logp`. On CPU
the arms run at the same time (single-threaded each, seeded: results do not depend on it, and
speed is not gated there); on a GPU one after the other, so timings are clean.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_rlk.e2e.arms import ArmCommand
from pytest_rlk.e2e.engine import ArmLayout, ArmReading, ReportExtras, RunContext, StepProgress
from pytest_rlk.e2e.engines.trl.series import ROLLOUTS_FILE, progress_from_line, read_run_info, read_series
from pytest_rlk.e2e.engines.trl.settings import TINY_PREFIX, TrlSettings
from pytest_rlk.e2e.launcher import ArmResult, LaunchConfig
from pytest_rlk.e2e.processes import pythonpath_first
from pytest_rlk.e2e.report import NO_MOE_CLAIM
from pytest_rlk.e2e.spec import ABSpec, ArmRole, Lane, SpecError

CHILD_MODULE = "pytest_rlk.e2e.engines.trl.child"
# The checkout (or installed tree) that holds pytest_rlk and kernels: the arms run from here.
SUITE_ROOT = str(Path(__file__).resolve().parents[4])


@dataclass(frozen=True)
class TrlContext(RunContext):
    repo_root: str = SUITE_ROOT


def machine_platform(spec: ABSpec) -> str:
    """The platform this machine is (the run manifest's tag: h100, h200, cpu...), which every
    verdict, report and baseline path names; the spec's markers say which classes it runs on."""
    from pytest_rlk.platform import detect

    return detect().tag if _settings(spec).device == "cuda" else "cpu"


def _settings(spec: ABSpec) -> TrlSettings:
    assert isinstance(spec.settings, TrlSettings), spec.engine
    return spec.settings


class TrlEngine:
    name = "trl"
    settings_model = TrlSettings
    scope = (
        "Scope: the kernel arm differs from the baseline only by the kernel switch shown below; only "
        "TRL's per-token log-probs (its fused LM-head log-prob path) are routed through our kernels. "
        "TRL's GRPO loss, ratio, clipping and KL are computed inline by TRL in both arms, so this "
        "report makes no claim about loss or ratio/KL kernels. " + NO_MOE_CLAIM
    )
    options = ()
    # the first step's policy, old policy and reference are the same weights (TRL copies the
    # reference from the policy; one optimizer step per rollout): kl_loss[0] is 0 (outcome.absolute_checks)
    step0_identities = True

    def prepare(self, spec: ABSpec, options: Mapping[str, Any], *, run_dir: str, for_run: bool) -> TrlContext:
        checkpoint = spec.model.hf_checkpoint
        if for_run and not checkpoint.startswith(TINY_PREFIX) and not (Path(checkpoint) / "config.json").exists():
            raise SpecError(f"{spec.case}: model.hf_checkpoint {checkpoint!r}: no config.json there")
        notes = (f"each arm: cwd {SUITE_ROOT}, the caller's environment without VIME_RL_KERNEL* plus the variables "
                 f"shown, timeout {spec.timeouts.job_s:g} s",)
        settings = _settings(spec)
        if settings.rollout == "vllm" and for_run:
            from pytest_rlk.e2e.engines.trl.vllm_rollout import VllmRolloutError, versions

            try:
                versions()
            except VllmRolloutError as exc:
                raise SpecError(f"{spec.case}: {exc}") from exc
        # A vLLM arm holds an engine and its KV cache (~1.7 GB on CPU): arms run one after the other.
        concurrent = settings.device == "cpu" and settings.rollout == "hf"
        return TrlContext(run_dir=run_dir, launch=LaunchConfig(mode="local"), label="trl",
                          concurrent_arms=concurrent, plan_notes=notes, platform=machine_platform(spec) if for_run else None)

    def arm_commands(self, spec: ABSpec, lane: Lane, ctx: TrlContext, layout: ArmLayout) -> tuple[ArmCommand, ArmCommand]:
        settings = _settings(spec)
        commands = []
        # the replay lane's baseline arm records what every other arm of that lane replays
        recorded = f"{ctx.run_dir}/replay/baseline/{ROLLOUTS_FILE}"
        for role in ("baseline", "kernels"):
            env = {**settings.env, **(spec.kernel_switch.env if role == "kernels" else {}), "PYTHONPATH": pythonpath_first(ctx.repo_root)}
            lane_args = ["--arm", role, "--out", layout.dirs[role]]
            if lane == "replay":
                lane_args += ["--record-rollouts", recorded] if layout.dirs[role] == f"{ctx.run_dir}/replay/baseline" \
                    else ["--replay-rollouts", recorded]
            argv = [sys.executable, "-m", CHILD_MODULE, "--spec", layout.spec_file, "--model-dir",
                    f"{ctx.run_dir}/model", *lane_args]
            if role == "kernels":
                argv += list(spec.kernel_switch.args)
            commands.append(ArmCommand(role, spec.arm_label(role), lane, argv, env, lane_args, workdir=ctx.repo_root,
                                       arm_env=dict(getattr(spec.arms, role).env)))
        return commands[0], commands[1]

    def read_arm(self, spec: ABSpec, command: ArmCommand, result: ArmResult, arm_dir: Path) -> ArmReading:
        reading = ArmReading()
        try:
            reading.series = read_series(arm_dir)
        except (OSError, ValueError) as exc:
            reading.problems.append(f"{command.label}: {exc}")
        try:
            reading.info = read_run_info(arm_dir)
        except (OSError, ValueError) as exc:
            if result.ok:
                reading.problems.append(f"{command.label}: no usable run record: {exc}")
        return reading

    def progress(self, line: str) -> StepProgress | None:
        return progress_from_line(line)

    def report_extras(self, spec: ABSpec, ctx: TrlContext, readings: Mapping[ArmRole, ArmReading],
                      wall_s: float) -> ReportExtras:
        kernel = readings["kernels"].info if "kernels" in readings else {}
        baseline = readings["baseline"].info if "baseline" in readings else {}
        if _settings(spec).rollout == "vllm":
            rollout = kernel.get("rollout") or baseline.get("rollout") or {}
            notes = [
                f"Rollout: {rollout.get('engine', 'vllm')} colocated (TRL's vLLM integration; engine dtype "
                f"{rollout.get('dtype', '?')}; weight sync: {rollout.get('weight_sync', '?')}). "
                "train_rollout_logprob_abs_diff is TRL's sampling/sampling_logp_difference/mean: the token mean of "
                "|log-prob of the training forward (the loss's path) - vLLM's sampling log-prob|; log-prob space.",
            ]
        else:
            notes = [
                "train_rollout_logprob_abs_diff: mean over samples of the masked token mean of |log-prob used by "
                "the loss - log-prob of the plain HF forward (what generation samples from)| at the rollout's "
                "weights; log-prob space.",
            ]
        if kernel:
            calls = kernel["patched_calls"]
            notes.insert(0, f"Kernel arm: backend {kernel['backend_id']}, patched {kernel['patched']} "
                            f"({calls.get('lm_head_logp', 0)} calls, {calls.get('tokens', 0)} tokens); fallback counts "
                            f"{kernel['fallback_counts'] or 'none'}.")
            notes.append(f"Initial weights digest: baseline {baseline.get('initial_weights_digest')}, "
                         f"kernel arm {kernel['initial_weights_digest']}.")
        if _settings(spec).device == "cpu":
            notes.append(
                "CPU lane: the kernel arm runs our Triton kernels through the Triton interpreter "
                "(TRITON_INTERPRET=1) with VIME_RL_KERNEL_STRICT=1, so a fallback would have failed the run; "
                "speed and memory are reported, not gated, on CPU.")
        return ReportExtras(
            hardware=kernel.get("hardware", f"{spec.hardware.gpus}x {spec.hardware.platform}"),
            setup_commands=["pip install -e '.[trl]'",
                            f"rlk e2e run {ctx.run_dir}/spec.json --out NEW_DIR   # both arms, the gate, this report"],
            notes=notes, versions=dict(kernel.get("versions", {})),
        )
