"""Capacity of a training step (GPU): the largest micro-batch each arm fits, and its tokens/s.

For HF Qwen3 at the 0.6B, 1.7B and 4B shapes (suites/module/capacity_models.py: random init, bf16,
fused AdamW), activation checkpointing off and on, and every arm of suites/module/capacity_arms.py
(vime's path: its own ``loss_function`` with ``--rlk-vime-root``, else the labelled fp32 reference
of its math; our ops on the logits; ``linear_logp``; Liger's fused-linear GRPO loss; TRL's chunked
LM head): the search of suites/module/capacity_search.py (doubling from one 4096-token sample, then
bisection to 10%), then tokens/s, peak memory and the step's breakdown at the common sizes and at
the arm's largest (suites/module/capacity_run.py). Each test is one arm on a fresh model, so an
arm's capacity does not depend on what ran before it in the process.

Gated like the op benchmarks: our arms' largest size (band: the search's resolution) and their
tokens/s at it (the throughput band); vime's path and the peers are recorded beside them, never
gated. One command per model size::

    pytest suites/module/bench_capacity.py --rlk-tier=module -m bench_full -k qwen3_0p6b

Marked ``bench_full`` (a job of its own, left out of the nightly gate's ``-m h200``): on a machine
without an H100 or H200 every test skips with the reason.
"""

from __future__ import annotations

import pytest
import torch

from pytest_rlk.extras import require_extra

require_extra("transformers")

from suites.module import capacity_arms, capacity_models, capacity_run  # noqa: E402

# a long benchmark (minutes per model): the bench_full job, never the nightly gate's -m h200
pytestmark = [pytest.mark.bench, pytest.mark.bench_full, pytest.mark.gpu, pytest.mark.h100, pytest.mark.h200]

SEQ_LEN = 4096
# The common sizes every arm that fits them is measured at: one and four 4096-token samples
COMMON_SIZES = (4096, 16384)
# The search's upper end per model: 256 samples at 0.6B (past the 8x of vime's path a recompute
# target asks for), less at the larger models, whose step time per token is longer
LIMITS = {"qwen3_0p6b": 1 << 20, "qwen3_1p7b": 1 << 19, "qwen3_4b": 1 << 18}
QUANTUM = 512  # sizes are multiples of it: a tenth of the resolution at the smallest bisection (4096 - 8192)
ARMS = (capacity_arms.VIME_PATH, *capacity_arms.our_and_peer_arms())


def capacity_case(model: str, recompute: bool) -> capacity_run.CapacityCase:
    return capacity_run.CapacityCase(capacity_models.QWEN3_SPECS[model], recompute, seq_len=SEQ_LEN, start=SEQ_LEN,
                                     limit=LIMITS[model], common_sizes=COMMON_SIZES, quantum=QUANTUM)


@pytest.mark.parametrize("arm_name", ARMS)
@pytest.mark.parametrize("recompute", [False, True], ids=["recompute_off", "recompute_on"])
@pytest.mark.parametrize("model", list(capacity_models.QWEN3_SPECS))
def test_capacity(model, recompute, arm_name, request, rlk_metrics, rlk_progress):
    vime_root = request.config.getoption("rlk_vime_root")
    arm = capacity_arms.arm_named(arm_name, vime_root)
    missing = arm.missing()
    if missing:
        pytest.skip(missing)
    case = capacity_case(model, recompute)
    rlk_metrics.set_case(f"capacity-{case.label}-{arm.name}")
    device = torch.device("cuda")
    with rlk_progress.step(f"{arm.name} on {case.label}: largest micro-batch, then tokens/s"):
        found = capacity_run.run_arm(case, arm, device, out_dir=rlk_metrics.artifact_dir, progress=rlk_progress)
    capacity_run.record(rlk_metrics, found, device, gate=arm.name.startswith("rlk"))
    fits = ", ".join(f"{t}: {m.tokens_per_s:.0f} tok/s, {(m.peak_bytes or 0) / 2**30:.1f} GiB"
                     for t, m in sorted(found.measured.items()))
    print(f"\n{arm.name} on {case.label} ({torch.cuda.get_device_name()}): largest {found.search.largest} tokens "
          f"(smallest out of memory: {found.search.smallest_failing}); {fits}")
    assert found.search.largest is not None, (
        f"{arm.name}: not even {case.start} tokens fit ({found.search.probes[0].out_of_memory})")
