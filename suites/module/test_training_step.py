"""A GRPO training step on real models, kernels on vs off from the same seed (see train_step.py).

Per step: loss and grad norm of the two arms agree; after k steps the parameters of the two arms
differ by a small fraction of the update itself. A timing breakdown per module (forward, logp,
ratio_kl, loss, backward, optimizer, step) and, on a GPU, peak memory are recorded per arm with
tags ``{"module": ..., "arm": ...}``.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from pytest_rlk.extras import require_extra

require_extra("transformers")  # tiny real models
require_extra("tokenizers")

from pytest_rlk.e2e.engines.task import make_prompts  # noqa: E402
from pytest_rlk.e2e.engines.tiny_models import train_tokenizer  # noqa: E402
from suites.module import tiny, train_step  # noqa: E402
from suites.module import vime_standin as standin  # noqa: E402

SEED = 1234
LOSS_FLAGS = ["--use-kl-loss", "--kl-loss-coef", "0.01", "--eps-clip-high", "0.28", "--use-tis"]


@dataclasses.dataclass(frozen=True)
class StepCase:
    kind: str
    vocab_size: int
    size: tiny.TinyModelSize
    dtype: torch.dtype
    n_prompts: int
    group_size: int
    response_len: int
    steps: int
    # Tolerances between the arms (kernels vs reference). fp32 on CPU: the log-prob differs in
    # the last bits only (summation order), so the arms stay within float rounding over k steps.
    loss_atol: float
    grad_norm_rtol: float
    drift_rel_max: float  # ||p_kernels - p_ref|| / ||p_ref - p_init||


TINY_CASES = {
    "dense": StepCase("dense", tiny.TINY_VOCAB, tiny.TINY_SIZE, torch.float32, 4, 2, 12, 3, 1e-5, 1e-4, 1e-3),
    "moe": StepCase("moe", tiny.TINY_VOCAB, tiny.TINY_SIZE, torch.float32, 4, 2, 12, 3, 1e-5, 1e-4, 1e-3),
}
# bf16 weights on the GPU: a last-bit difference in a gradient can flip a bf16 rounding of a
# parameter, so later steps drift more than in fp32; the first step's loss is still fp32-close.
GPU_CASE = StepCase("dense", tiny.QWEN3_0P6B_VOCAB, tiny.QWEN3_0P6B_SIZE, torch.bfloat16, 2, 4, 256, 3,
                    2e-3, 2e-2, 5e-2)


def _prompts(n: int, vocab_size: int) -> list[torch.Tensor]:
    if vocab_size == tiny.TINY_VOCAB:
        tokenizer = train_tokenizer()
        return [torch.tensor(tokenizer(row["prompt"])["input_ids"]) for row in make_prompts(n, SEED)]
    gen = torch.Generator().manual_seed(SEED)  # large vocab: random prompt ids, 32 tokens each
    return [torch.randint(0, vocab_size, (32,), generator=gen) for _ in range(n)]


def run_case(case: StepCase, device: torch.device, kernels_arm, rlk_metrics, progress) -> None:
    with progress.step(f"build a tiny {case.kind} model, sample a rollout"):
        base = tiny.build_model(case.kind, seed=SEED, vocab_size=case.vocab_size, size=case.size,
                                dtype=case.dtype, device=device)
        rollout = train_step.sample_rollout(base, _prompts(case.n_prompts, case.vocab_size),
                                            group_size=case.group_size, response_len=case.response_len, seed=SEED)
        batch = train_step.vime_batch(base, rollout)
    args = standin.vime_args_standin(LOSS_FLAGS)
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    logs, models = {}, {}
    for arm, on in (("reference", False), ("kernels", True)):
        kernels_arm(on)
        models[arm] = copy.deepcopy(base)
        with progress.step(f"{arm} arm: {case.steps} training steps"):
            logs[arm] = train_step.train(models[arm], batch, args, steps=case.steps)
    ref, ker = logs["reference"], logs["kernels"]
    gap_max, drift_rel = train_step.param_drift(models["kernels"], models["reference"], start)
    rlk_metrics.set_seed("torch", SEED)

    loss_err = max(abs(a - b) for a, b in zip(ker.loss, ref.loss))
    gn_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ker.grad_norm, ref.grad_norm))
    tags = {"model": case.kind, "device": device.type}
    # Timings and memory gate against the platform baseline on a GPU only (shared CPU cores are noisy).
    perf_gate = device.type == "cuda"
    for arm, log in logs.items():
        rlk_metrics.record(f"{arm}_loss", log.loss, direction="two_sided", space="loss", tags={**tags, "arm": arm},
                           gate=False)
        rlk_metrics.record(f"{arm}_grad_norm", log.grad_norm, direction="two_sided", space="none",
                           tags={**tags, "arm": arm}, gate=False)
        for module, values in log.times_ms.items():
            rlk_metrics.record(f"{arm}_{module}_ms", values, unit="ms", direction="lower_is_better", space="time",
                               tags={**tags, "module": module, "arm": arm}, gate=perf_gate,
                               window={"skip": 1, "agg": "median"})
        if log.peak_memory_mb is not None:
            rlk_metrics.record(f"{arm}_peak_extra_memory_mb", log.peak_memory_mb, unit="MiB", direction="lower_is_better",
                               space="memory", tags={**tags, "arm": arm}, gate=perf_gate)
    rlk_metrics.record("loss_max_abs_diff", loss_err, direction="lower_is_better", space="error", tags=tags,
                       band={"abs_floor": case.loss_atol, "source": "StepCase tolerance"})
    rlk_metrics.record("grad_norm_max_rel_diff", gn_err, direction="lower_is_better", space="error", tags=tags,
                       band={"abs_floor": case.grad_norm_rtol, "source": "StepCase tolerance"})
    rlk_metrics.record("param_max_abs_diff", gap_max, direction="lower_is_better", space="error", tags=tags,
                       gate=False)
    rlk_metrics.record("param_drift_rel", drift_rel, direction="lower_is_better", space="error", tags=tags,
                       band={"abs_floor": case.drift_rel_max, "source": "StepCase tolerance"})

    (rlk_metrics.artifact_dir / "steps.json").write_text(json.dumps(
        {"case": {"kind": case.kind, "vocab_size": case.vocab_size, "size": dataclasses.asdict(case.size),
                  "dtype": str(case.dtype), "steps": case.steps, "device": device.type},
         "arms": {arm: dataclasses.asdict(log) for arm, log in logs.items()},
         "param_max_abs_diff": gap_max, "param_drift_rel": drift_rel}, indent=1))

    assert ref.fallbacks == 0 and ker.fallbacks == 0
    assert len(set(ref.loss)) > 1, f"the loss did not move over {case.steps} steps: {ref.loss}"
    assert loss_err <= case.loss_atol, f"per-step loss kernels {ker.loss} vs reference {ref.loss}"
    assert gn_err <= case.grad_norm_rtol, f"grad norm kernels {ker.grad_norm} vs reference {ref.grad_norm}"
    assert drift_rel <= case.drift_rel_max, f"parameter drift {drift_rel:.3g} of the update (max abs {gap_max:.3g})"


@pytest.mark.tiny
@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.moe)])
def test_tiny_training_step_kernels_match_reference(kind, kernels_arm, device, rlk_metrics, rlk_progress):
    run_case(TINY_CASES[kind], device, kernels_arm, rlk_metrics, rlk_progress)


@pytest.mark.gpu
@pytest.mark.gpu_mem(40)
def test_qwen3_0p6b_sized_training_step(kernels_arm, rlk_metrics, rlk_progress):
    """Qwen3-0.6B-sized random model, bf16 weights, fp32 logits [~2300, 151936]; baselines: h100."""
    run_case(GPU_CASE, torch.device("cuda"), kernels_arm, rlk_metrics, rlk_progress)
