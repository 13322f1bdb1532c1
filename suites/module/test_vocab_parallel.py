"""Vocab-parallel log-prob and vime loss, logits sharded over TP ranks (real processes, real
megatron-core): Megatron's vocab-parallel cross-entropy is the reference for the log-prob; kernels
on and off agree on log-probs, loss, metrics and dlogits. See vocab_parallel_worker.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from pytest_rlk.extras import require_extra

require_extra("megatron.core")  # imported by the worker processes

from suites.module.vocab_parallel_worker import run_worker  # noqa: E402

VOCAB = 96  # divisible by every TP size used here; small for the Triton interpreter on CPU
SEED = 7
# fp32 throughout: one all-reduce order differs between implementations, nothing else.
LOGP_ATOL = 2e-6
GRAD_ATOL = 1e-6
LOSS_ATOL = 1e-5
TOLERANCES = {
    "logp_megatron_vs_ref": LOGP_ATOL, "logp_kernels_vs_megatron": LOGP_ATOL, "logp_kernels_vs_ref": LOGP_ATOL,
    "dlogits_logp_megatron_vs_ref": GRAD_ATOL, "dlogits_logp_kernels_vs_megatron": GRAD_ATOL,
    "loss_kernels_vs_ref": LOSS_ATOL, "metrics_kernels_vs_ref": LOSS_ATOL, "dlogits_loss_kernels_vs_ref": GRAD_ATOL,
    "loss_tp_vs_single_device": LOSS_ATOL, "dlogits_tp_vs_single_device": GRAD_ATOL,
}


# gloo runs CPU tensors, whose kernel arm needs Triton's interpreter: switched on only on
# CPU-only hosts (suites/module/conftest.py). On a CUDA host the NCCL variants run the kernels.
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only variant; the nccl variants run on CUDA hosts")


@pytest.mark.parametrize(
    "backend, world",
    [
        pytest.param("gloo", 1, id="gloo-tp1", marks=CPU_ONLY),
        pytest.param("gloo", 2, id="gloo-tp2", marks=CPU_ONLY),
        pytest.param("nccl", 1, id="nccl-tp1", marks=pytest.mark.gpu),
        pytest.param("nccl", 2, id="nccl-tp2", marks=pytest.mark.gpus(2)),
    ],
)
def test_vocab_parallel_kernels_match_megatron(backend, world, tmp_path, rlk_metrics, rlk_progress):
    rlk_metrics.set_seed("case", SEED)
    with rlk_progress.step(f"{world} {backend} rank process(es): Megatron, kernels off and on"):
        mp.spawn(run_worker, args=(world, str(tmp_path / "init"), backend, str(tmp_path), VOCAB, SEED),
                 nprocs=world, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, out in enumerate(ranks):
        assert out["backend_ref"].startswith("reference"), f"rank {r}: {out['backend_ref']}"
        assert out["backend_kernels"].startswith("rlk-triton"), f"rank {r}: {out['backend_kernels']}"
        assert out["fallback_ref"] == 0.0 and out["fallback_kernels"] == 0.0
        rlk_metrics.record_backend(out["backend_id_kernels"])
    failures = []
    for name, atol in TOLERANCES.items():
        worst = max(out[name] for out in ranks)
        rlk_metrics.record(name, worst, direction="lower_is_better", space="error",
                           tags={"tp": world, "backend": backend},
                           band={"abs_floor": atol, "source": "suites/module/test_vocab_parallel.py tolerance"})
        if not worst <= atol:
            failures.append(f"{name}={worst:.3g} > {atol:g}")
    assert not failures, f"TP={world} ({backend}): " + "; ".join(failures)
