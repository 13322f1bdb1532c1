"""The rollouts the semantics rung and the precision matrix score: the tiny dense drift model, two
engine loads in one vLLM child (the log-prob mode and the dtype are engine settings; every
sampling setting of a load is a request on the same engine).

* bf16, ``processed_logprobs``: the precision matrix's bf16 row (temperature 1), and the semantics
  cells top-p 0.9 (vime issue 69), top-k 16, and temperature 0.7 (processed: aligned with training);
  and the lr=0 lane's steps (temperature 1, a seed per step: the weights frozen, sampling on);
* fp16, ``raw_logprobs``: the precision matrix's fp16 row (temperature 1: raw and processed
  log-probs coincide) and the semantics cell temperature 0.7 with raw log-probs (vime issue 64).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from pytest_rlk.drift import rollout
from pytest_rlk.drift.batch import Sampling
from suites.module import tiny

SAMPLING = Sampling(temperature=1.0, n=4, max_tokens=32, seed=tiny.DRIFT_SEED)
ENGINES = {
    "bf16-processed": {"dtype": "bfloat16", "logprobs_mode": "processed_logprobs"},
    "fp16-raw": {"dtype": "float16", "logprobs_mode": "raw_logprobs"},
}
# name: (engine, sampling changes)
REQUESTS = {
    "precision-bf16": ("bf16-processed", {}),
    "top_p 0.9, processed": ("bf16-processed", {"top_p": 0.9}),
    "top_k 16, processed": ("bf16-processed", {"top_k": 16}),
    "temperature 0.7, processed": ("bf16-processed", {"temperature": 0.7}),
    "precision-fp16": ("fp16-raw", {}),
    "temperature 0.7, raw": ("fp16-raw", {"temperature": 0.7}),
}
LR0_STEPS = 3
REQUESTS |= {f"lr0 step {k}": ("bf16-processed", {"seed": tiny.DRIFT_SEED + 1 + k}) for k in range(LR0_STEPS)}
SEMANTICS_CELLS = [name for name in REQUESTS if not name.startswith(("precision-", "lr0 "))]
PRECISION_ROLLOUTS = {"bf16": "precision-bf16", "fp16": "precision-fp16"}


@dataclasses.dataclass
class MismatchRollouts:
    model_dir: Path
    rollouts: dict[str, dict]  # request name -> the engine's output (pytest_rlk.drift.rollout)
    wall_s: float  # the vLLM child, both engine loads


def roll_out(out_dir: Path) -> MismatchRollouts:
    """Build the dense drift model under ``out_dir`` and run every request (one vLLM child)."""
    out_dir = Path(out_dir)
    model_dir = tiny.save_model_dir("dense", out_dir / "dense", seed=tiny.DRIFT_SEED,
                                    lm_head_std=tiny.TRAINED_LIKE_LM_HEAD_STD)
    prompts = tiny.drift_prompts()
    jobs, names = [], []
    for engine, settings in ENGINES.items():
        reqs = []
        for name, (eng, changes) in REQUESTS.items():
            if eng != engine:
                continue
            sampling = dataclasses.replace(SAMPLING, **changes)
            request = rollout.request_for(prompts, sampling, gpu_memory_utilization=0.3, max_model_len=64, **settings)
            reqs.append({"out": str(out_dir / f"rollout-{len(names)}.json"), "request": request})
            names.append(name)
        jobs.append({"model": str(model_dir), "requests": reqs})
    t0 = time.perf_counter()
    outputs = [o for job in rollout.run_engine_jobs(jobs, out_dir) for o in job]
    return MismatchRollouts(model_dir, dict(zip(names, outputs)), time.perf_counter() - t0)
