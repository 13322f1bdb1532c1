"""One rank of the vocab-parallel check (started by ``torch.multiprocessing.spawn``).

Each rank holds its vocab shard ``[rank * V_local, (rank + 1) * V_local)`` of the same global logits
(gloo on CPU, NCCL on GPUs), with Megatron's TP group from ``parallel_state.initialize_model_parallel``.
It computes, on its shard:

* the selected log-prob from megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy``
  (logp = -CE; it modifies its input in place, so it gets a copy) - the Megatron reference;
* the same with ``kernels.logp`` with the kernels off (reference) and on;
* the d(sum w * logp)/dlogits of all three;
* vime's loss through the adapter (``--tensor-model-parallel-size`` = world) with kernels off and on,
  its metrics and dlogits; and the single-device reference loss on the full logits.

Max abs differences go to ``out_dir/rank<r>.json``; the test asserts and records them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

LOSS_FLAGS = ["--use-kl-loss", "--kl-loss-coef", "0.05", "--use-tis", "--eps-clip-high", "0.28"]
METRICS = ("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "train_rollout_logprob_abs_diff")


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def _logp_and_grad(fn, shard: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = shard.clone().requires_grad_(True)
    logp = fn(leaf)
    (logp * weights).sum().backward()
    return logp.detach(), leaf.grad


def run_worker(rank: int, world: int, init_file: str, backend: str, out_dir: str, vocab: int, seed: int) -> None:
    from megatron.core import parallel_state, tensor_parallel

    import kernels
    from kernels.integrations import vime as adapter
    from suites.module import vime_standin as standin
    from suites.module.loss_cases import batch_to, expected_loss, make_case, run_adapter

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(world, 1)
        group = parallel_state.get_tensor_model_parallel_group()
        batch, logits = make_case(seed=seed, vocab=vocab)
        batch = batch_to(batch, device)
        logits = logits.to(device)
        v_local = vocab // world
        shard = logits[:, rank * v_local:(rank + 1) * v_local].contiguous()
        rows, ids = standin.response_rows_standin(batch)
        rows, ids = rows.to(device), ids.to(device)
        weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)

        def megatron_logp(leaf: torch.Tensor) -> torch.Tensor:
            # [T, V_local] -> [T, 1, V_local] (Megatron's [s, b, v]); the copy absorbs the in-place edits.
            return -tensor_parallel.vocab_parallel_cross_entropy(leaf[rows].clone()[:, None, :], ids[:, None])[:, 0]

        def kernels_logp(leaf: torch.Tensor) -> torch.Tensor:
            return kernels.logp(leaf[rows].contiguous(), ids, tp_group=group)

        out: dict[str, float | str] = {}
        logp_meg, grad_meg = _logp_and_grad(megatron_logp, shard, weights)
        arms = {}
        for arm, on in (("ref", False), ("kernels", True)):
            # the reference arm: the same adapter path on the fp32 reference backend
            os.environ["VIME_RL_KERNEL"] = "1"
            os.environ["VIME_RL_KERNEL_BACKEND"] = "rlk-triton" if on else "reference"
            os.environ["VIME_RL_KERNEL_STRICT"] = "1"
            logp, grad = _logp_and_grad(kernels_logp, shard, weights)
            args = standin.vime_args_standin([*LOSS_FLAGS, "--tensor-model-parallel-size", str(world)])
            loss, metrics, dlogits = run_adapter(args, batch, shard)
            arms[arm] = (logp, grad, loss, metrics, dlogits)
            out[f"backend_{arm}"] = adapter.backend_from_metrics(metrics) or ""
            out[f"backend_id_{arm}"] = kernels.backend_id()
            out[f"fallback_{arm}"] = float(metrics["rlk_fallback"])
        ref, ker = arms["ref"], arms["kernels"]
        out["logp_megatron_vs_ref"] = _max_abs(logp_meg, ref[0])
        out["logp_kernels_vs_megatron"] = _max_abs(ker[0], logp_meg)
        out["logp_kernels_vs_ref"] = _max_abs(ker[0], ref[0])
        out["dlogits_logp_megatron_vs_ref"] = _max_abs(grad_meg, ref[1])
        out["dlogits_logp_kernels_vs_megatron"] = _max_abs(ker[1], grad_meg)
        out["loss_kernels_vs_ref"] = abs(float(ker[2]) - float(ref[2]))
        out["metrics_kernels_vs_ref"] = max(abs(float(ker[3][m]) - float(ref[3][m])) for m in METRICS)
        out["dlogits_loss_kernels_vs_ref"] = _max_abs(ker[4], ref[4])
        # The single-device reference on the full vocab: the TP loss is the same number and the
        # shard's gradient is the matching slice of the full gradient.
        full_args = standin.vime_args_standin(LOSS_FLAGS)
        full_leaf = logits.clone().requires_grad_(True)
        full_loss, _ = expected_loss(full_args, batch, full_leaf)
        full_loss.backward()
        out["loss_tp_vs_single_device"] = abs(float(ref[2]) - float(full_loss))
        out["dlogits_tp_vs_single_device"] = _max_abs(
            ker[4], full_leaf.grad[:, rank * v_local:(rank + 1) * v_local])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
