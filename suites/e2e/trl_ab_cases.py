"""What the TRL A/B tests share: the shipped specs they run, the perturbed kernel arm (a test-only
backend adding a log-prob bias, chosen by dotted path), each arm's series recorded into the run
(the kernel arm's gated against the stored baselines), and the check that the kernel arm really ran
our kernels."""

from __future__ import annotations

import perturbed_logp_backend as perturbed_backend

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.outcome import ABRun
from pytest_rlk.e2e.spec import SPECS_DIR, ABSpec

DENSE_CPU = SPECS_DIR / "trl-qwen3-tiny-dense-cpu.json"
MOE_CPU = SPECS_DIR / "trl-qwen3-tiny-moe-cpu.json"
SMALL_GPU = SPECS_DIR / "trl-qwen3-small-gpu.json"
REPLAY_CPU = SPECS_DIR / "trl-qwen3-tiny-dense-replay-cpu.json"
DENSE_VLLM_CPU = SPECS_DIR / "trl-qwen3-tiny-dense-vllm-cpu.json"
PERTURB_ROLLOUTS = 5  # the perturbed arm only has to show the gate fails (window: steps 2..4)
PERTURBED = "kernels_perturbed"
# The perturbed kernel arm's environment: a backend that adds LOGP_BIAS to every log-prob.
PERTURB_ENV = {"VIME_RL_KERNEL_BACKEND": perturbed_backend.DOTTED_PATH}


def record_arm_metrics(rlk_metrics, run: ABRun, *, gate_speed: bool, gate_memory: bool | None = None,
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


def assert_real_kernel_arm(run: ABRun, key: str = "kernels", backend: str = "rlk-triton") -> None:
    info, base = run.arm(key).info, run.arm("baseline").info
    assert info["kernels_installed"] and not base["kernels_installed"]
    assert info["patched"] == "trl.trainer.utils._ChunkedLogProbFunction"
    assert info["patched_calls"]["lm_head_logp"] >= 2 * run.arm(key).spec.hyperparameters.num_rollout
    assert info["backend_id"].startswith(backend + "/"), info["backend_id"]
    assert info["fallback_counts"] == {} and info["env"].get("VIME_RL_KERNEL_STRICT") == "1"
    assert info["initial_weights_digest"] == base["initial_weights_digest"]


def perturbed_variant(spec: ABSpec, rollouts: int = PERTURB_ROLLOUTS) -> ABSpec:
    return spec.arm_variant("kernels", f"test-only log-prob bias {perturbed_backend.LOGP_BIAS:g}", env=PERTURB_ENV,
                            num_rollout=rollouts)
