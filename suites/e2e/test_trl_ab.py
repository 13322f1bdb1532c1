"""TRL lane: a real GRPOTrainer A/B (baseline vs our kernels in TRL's log-prob path).

The CPU case trains a tiny random-init Qwen3 for 16 GRPO steps per arm, runs the two arms plus a
test-only perturbed kernel arm of 5 steps concurrently (one thread each; 65-90 s on 2 cores), and
checks: the A/B gate passes, the perturbed arm fails it, the report has its plots and
reproducibility notes, and the kernels really ran (patched calls > 0, strict mode, no fallback).
The MoE case (55-70 s) runs through `rlk e2e run`, proving the CLI hands TRL specs to this engine;
the replay lane trains both arms on the same recorded rollouts and catches a gradient fault; the
GPU case (larger model, bf16) learns, passes both lanes and records the platform's baseline.

The perturbed arm is an extra arm of the runner (`ExtraArm`): a variant of the spec with fewer
rollouts whose kernel arm declares its own environment (`arms.kernels.env`): it selects the
test-only backend suites/e2e/perturbed_logp_backend.py (rlk-triton plus a log-prob bias) by its
dotted path. Neither the engine nor the product knows of it.

A real vLLM rollout: test_trl_vllm_ab.py; the integration's and the engine's fast in-process
checks: test_trl_integration.py; what they share: trl_ab_cases.py.
"""

from __future__ import annotations

import json

import pytest

from pytest_rlk.extras import require_extra

require_extra("trl")
require_extra("datasets")  # TRL's GRPOTrainer reads its prompts from a datasets.Dataset

import perturbed_logp_backend as perturbed_backend  # noqa: E402

from pytest_rlk.e2e import metrics as m  # noqa: E402
from pytest_rlk.prove import faults  # noqa: E402
from pytest_rlk.e2e.outcome import ABRun, ExtraArm, gate_arms, load_ab_run, write_run_report  # noqa: E402
from pytest_rlk.e2e.progress import LineProgress  # noqa: E402
from pytest_rlk.e2e.runner import run_ab  # noqa: E402
from pytest_rlk.e2e.spec import ABSpec, load_spec  # noqa: E402
from suites.e2e.trl_ab_cases import (  # noqa: E402
    DENSE_CPU,
    MOE_CPU,
    PERTURBED,
    PERTURB_ENV,
    PERTURB_ROLLOUTS,
    REPLAY_CPU,
    SMALL_GPU,
    assert_real_kernel_arm,
    perturbed_variant,
    record_arm_metrics,
)


# ------------------------------------------------------------------------------------------
# The CPU A/B (dense): passes; the perturbed kernel arm fails; the report is complete.
# ------------------------------------------------------------------------------------------


class _ToTerminal:
    """A stream whose lines go to the terminal as rlk progress lines (through pytest's capture)."""

    def __init__(self, progress) -> None:
        self.progress = progress

    def write(self, text: str) -> None:
        if text.strip():
            self.progress(text.rstrip())

    def flush(self) -> None:
        pass


class _EveryFourthRollout(LineProgress):
    """The runner's lines (arms starting and ending), and every fourth rollout of each arm."""

    def step(self, arm, step, total) -> None:
        if (step.index + 1) % 4 == 0 or step.index + 1 == total:
            super().step(arm, step, total)


@pytest.fixture(scope="module")
def dense_cpu_ab(tmp_path_factory, rlk_progress, cpu_kernels_reason) -> ABRun:
    if cpu_kernels_reason:
        pytest.skip(f"the CPU lane's kernels arm cannot run here: {cpu_kernels_reason}")
    out = tmp_path_factory.mktemp("trl_ab_dense_cpu")
    spec = load_spec(DENSE_CPU)
    with rlk_progress.step(f"TRL GRPO A/B {DENSE_CPU.stem}: baseline, kernels and a perturbed arm "
                           f"(65-90 s on 2 cores)"):
        return run_ab(spec, out, extra_arms=[ExtraArm(PERTURBED, perturbed_variant(spec))],
                      progress=_EveryFourthRollout(_ToTerminal(rlk_progress)))


@pytest.mark.cpu
@pytest.mark.tiny
def test_trl_cpu_ab_gate_passes(dense_cpu_ab, rlk_metrics):
    run = dense_cpu_ab
    verdict = gate_arms(run)
    assert run.passed and verdict.passed == run.verdict.passed
    record_arm_metrics(rlk_metrics, run, gate_speed=False)
    rlk_metrics.record("ab_wall_s", run.wall_s, unit="s", direction="lower_is_better", space="time", gate=False)
    assert verdict.passed, verdict.failures()
    gated = {c.name for c in verdict.gate.comparisons}
    assert {m.RAW_REWARD, m.ABS_DIFF, m.KL_LOSS, m.FALLBACK_COUNT} <= gated
    assert_real_kernel_arm(run)
    # The kernel arm really computed the log-probs the loss used: equal to the rollout path to fp32 noise.
    assert max(run.arm("kernels").series[m.ABS_DIFF]) < 1e-4
    # The task is learnt: raw_reward rises from its random-init level in both arms.
    for key in ("baseline", "kernels"):
        reward = run.arm(key).series[m.RAW_REWARD]
        assert sum(reward[-6:]) / 6 > sum(reward[:4]) / 4 + 0.05, (key, reward)


@pytest.mark.cpu
@pytest.mark.tiny
def test_trl_cpu_ab_perturbed_kernel_arm_fails_gate(dense_cpu_ab):
    run = dense_cpu_ab
    perturbed = run.arm(PERTURBED)
    assert {k: perturbed.info["env"].get(k) for k in PERTURB_ENV} == PERTURB_ENV
    assert not set(PERTURB_ENV) & set(run.arm("kernels").info["env"])
    assert_real_kernel_arm(run, PERTURBED, backend=perturbed_backend.BACKEND_ID)
    assert len(perturbed.series[m.RAW_REWARD]) == PERTURB_ROLLOUTS
    # Same seeds: until the bias matters, the perturbed arm trains exactly like the kernel arm.
    expected = run.arm("kernels").series[m.RAW_REWARD][:PERTURB_ROLLOUTS]
    assert perturbed.series[m.RAW_REWARD] == pytest.approx(expected, abs=1e-3)
    verdict = gate_arms(run, kernels_key=PERTURBED)
    assert not verdict.passed
    failed = {c.name for c in verdict.gate.regressions}
    assert failed & {m.ABS_DIFF, m.RAW_REWARD}, verdict.failures()


@pytest.mark.cpu
@pytest.mark.tiny
def test_trl_cpu_ab_report_has_plots_and_reproducibility_notes(dense_cpu_ab, rlk_metrics):
    run = dense_cpu_ab
    paths = write_run_report(run, rlk_metrics.artifact_dir / "report")
    names = {p.name for p in paths.plots}
    assert {"step_time_mean.png", "step_time_steps.png", "module_breakdown.png", "reward_absdiff.png"} <= names
    for plot in paths.plots:
        assert plot.stat().st_size > 1000, plot
    text = paths.markdown.read_text()
    for needle in ("Pair verdict: PASS", "VIME_RL_KERNEL=1", "--arm baseline", "--arm kernels", "trl 1.16",
                   "Triton interpreter", "Initial weights digest", '"seed": 1234', "repeat"):
        assert needle in text, needle
    # the machine by its CPU model (not only its architecture) and the Triton the arms ran
    import importlib.metadata

    from pytest_rlk.platform import cpu_model

    assert f"Hardware: {cpu_model()} (" in text and f"triton {importlib.metadata.version('triton')}" in text


# ------------------------------------------------------------------------------------------
# MoE on CPU through `rlk e2e run`, and the larger GPU config (records the h100 baseline).
# ------------------------------------------------------------------------------------------


@pytest.mark.cpu
@pytest.mark.tiny
@pytest.mark.moe
def test_trl_cpu_ab_moe_through_rlk_e2e_run_passes_the_gate(tmp_path, rlk_metrics, capsys, rlk_progress,
                                                            cpu_kernels_reason):
    """`rlk e2e run <shipped MoE case>`: the CLI hands the TRL spec to this engine end to end."""
    from pytest_rlk.cli import main as rlk_main

    if cpu_kernels_reason:
        pytest.skip(f"the CPU lane's kernels arm cannot run here: {cpu_kernels_reason}")

    out = tmp_path / "run"
    with rlk_progress.step(f"rlk e2e run {MOE_CPU.stem} (TRL GRPO A/B, 55-70 s on 2 cores; arm logs under {out})"):
        assert rlk_main(["e2e", "run", MOE_CPU.stem, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert f"A/B {MOE_CPU.stem} on cpu: PASS" in printed.out and f"report: {out / 'report' / 'report.md'}" in printed.out
    # progress while the arms ran: every rollout of both arms, with its reward
    for arm in ("trl", "trl+kernels"):
        assert f"[{arm}] rollout 16/16: raw_reward " in printed.err and f"[{arm}] succeeded in " in printed.err
    assert json.loads((out / "ab_result.json").read_text())["passed"]
    run = load_ab_run(out)
    verdict = gate_arms(run)
    record_arm_metrics(rlk_metrics, run, gate_speed=False)
    assert verdict.passed, verdict.failures()
    assert_real_kernel_arm(run)
    report = (out / "report" / "report.md").read_text()
    assert "only TRL's per-token log-probs" in report and "| peak_rss_mib [MiB] | trl (live) |" in report


# ------------------------------------------------------------------------------------------
# The replay lane on CPU: both arms train on the same recorded rollouts; a gradient fault fails it.
# ------------------------------------------------------------------------------------------

GRAD_FAULT = "kernels_grad_fault"
GRAD_FAULT_SIZE = -0.5  # the log-prob's gradient x (1 + size) = x 0.5 on every other token


def fault_variant(spec: ABSpec, fault: str, size: float) -> ABSpec:
    """The spec with a kernel arm on an injected fault (pytest_rlk.prove.faults, by dotted path)."""
    return spec.arm_variant("kernels", f"injected fault {fault}={size:g}", env=faults.arm_env(fault, size))


@pytest.fixture(scope="module")
def replay_cpu_ab(tmp_path_factory, rlk_progress, cpu_kernels_reason) -> ABRun:
    if cpu_kernels_reason:
        pytest.skip(f"the CPU lane's kernels arm cannot run here: {cpu_kernels_reason}")
    out = tmp_path_factory.mktemp("trl_ab_replay_cpu")
    spec = load_spec(REPLAY_CPU)
    fault = ExtraArm(GRAD_FAULT, fault_variant(spec, "logp_grad_scale_even", GRAD_FAULT_SIZE), lane="replay")
    with rlk_progress.step(f"TRL GRPO replay lane {REPLAY_CPU.stem}: baseline records, the kernel arm and a "
                           "gradient-fault arm replay (one after the other)"):
        return run_ab(spec, out, extra_arms=[fault], progress=_EveryFourthRollout(_ToTerminal(rlk_progress)))


@pytest.mark.cpu
@pytest.mark.tiny
def test_trl_cpu_replay_lane_passes_with_the_kernel_loss(replay_cpu_ab, rlk_metrics):
    run = replay_cpu_ab
    assert run.passed, run.verdict.summary() if run.verdict else run.failures
    info = run.arm("kernels", "replay").info
    assert info["kernel_ops"] == ["logp", "ratio_kl"] and info["kernel_loss"]
    assert info["fallback_counts"] == {}
    assert info["rollout"]["replayed_from"].endswith("replay/baseline/rollouts.jsonl")
    base = run.arm("baseline", "replay")
    assert base.info["initial_weights_digest"] == info["initial_weights_digest"]
    assert base.info["warm_start"]["steps"] == 30
    # same samples: the rewards are the recorded ones, step by step
    assert run.arm("kernels", "replay").series[m.RAW_REWARD] == base.series[m.RAW_REWARD]
    verdict = gate_arms(run, "replay")
    gated = {c.name.split("[")[0] for c in verdict.gate.comparisons}
    assert {m.LOSS, m.GRAD_NORM, m.KL_LOSS} <= gated


@pytest.mark.cpu
@pytest.mark.tiny
def test_trl_cpu_replay_lane_catches_a_gradient_fault(replay_cpu_ab):
    """dlogp x 0.5 on every other token: the forward is exact, so the rewards and the step-0 loss
    agree; the update differs, which the step-by-step gradient norm and the later losses catch."""
    verdict = gate_arms(replay_cpu_ab, "replay", kernels_key=GRAD_FAULT)
    assert not verdict.passed
    failed = {f.split("[")[0] for f in verdict.failures()}
    assert m.GRAD_NORM in failed, verdict.failures()
    assert not any(f.startswith(f"{m.LOSS}[0]") for f in verdict.failures())  # the forward is not the fault


# ------------------------------------------------------------------------------------------
# The GPU A/B (one H100 or H200): the policy learns, both lanes pass, the kernels ran.
# ------------------------------------------------------------------------------------------

REWARD_RISE_MIN = 0.1  # last-5 over first-3 rollouts' mean raw_reward of the baseline arm (docs/e2e-trl.md)


def reward_rise(series: list[float]) -> float:
    return sum(series[-5:]) / 5 - sum(series[:3]) / 3


@pytest.mark.h100
@pytest.mark.h200
@pytest.mark.exclusive_gpu  # gates the arms' peak VRAM, which NVML reads for the whole device
def test_trl_gpu_ab_learns_and_passes_both_lanes(tmp_path, rlk_metrics, rlk_progress):
    spec = load_spec(SMALL_GPU)
    with rlk_progress.step(f"TRL GRPO A/B {SMALL_GPU.stem}: replay and live lanes, 4 arms one after the other"):
        run = run_ab(spec, tmp_path, progress=_EveryFourthRollout(_ToTerminal(rlk_progress)))
    record_arm_metrics(rlk_metrics, run, gate_speed=spec.gates.speed, gate_memory=spec.gates.memory)
    paths = write_run_report(run, rlk_metrics.artifact_dir / "report")
    assert paths.markdown.exists()
    assert run.verdict is not None and f" on {run.platform}:" in run.verdict.summary()
    assert run.platform != "gpu"  # the machine's class, never the spec's
    assert run.passed, run.verdict.summary()
    for lane in ("replay", "live"):
        info = run.arm("kernels", lane).info
        assert info["kernel_ops"] == ["linear_logp", "ratio_kl"] and info["kernel_loss"], info["kernel_ops"]
        assert info["fallback_counts"] == {} and info["env"].get("VIME_RL_KERNEL_STRICT") == "1"
    rewards = run.arm("baseline", "live").series[m.RAW_REWARD]
    rlk_metrics.record("baseline.raw_reward_rise", reward_rise(rewards), direction="higher_is_better",
                       space="reward", gate=False)
    assert reward_rise(rewards) > REWARD_RISE_MIN, rewards
    assert m.PEAK_VRAM in run.arm("kernels").series
