"""Vocab-parallel TP = 2 equals TP = 1: logp values and gradients, and the GRPO loss (whose TP
path composes the vocab-parallel logp kernel with the loss math).

Two real processes (torch.multiprocessing spawn), gloo on CPU (Triton interpreter, inherited
TRITON_INTERPRET) or NCCL on two GPUs. Each rank holds ``logits[:, rank*V_local:(rank+1)*V_local]``;
ids cover both shards, the shard boundary and an ignored row.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels import LossConfig, tolerances

V_LOCAL = 517  # odd: partial last tile on each shard
T = 24
LENGTHS = [10, 6, 8]
CONFIG = LossConfig(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.1, kl_type="low_var_kl", use_tis=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _case_inputs(world: int, temperature_seed: int, device: str):
    gen = torch.Generator().manual_seed(100 + temperature_seed)
    vocab = V_LOCAL * world
    logits = torch.randn(T, vocab, generator=gen) * 3.0
    ids = torch.randint(0, vocab, (T,), generator=gen)
    ids[:4] = torch.tensor([V_LOCAL - 1, V_LOCAL, vocab - 1, -100])
    grad = torch.randn(T, generator=gen)
    logp0 = torch.log_softmax(logits, -1).gather(-1, ids.clamp(min=0)[:, None]).squeeze(-1)
    loss_kw = {
        "old_logp": logp0 + 0.3 * torch.randn(T, generator=gen),
        "ref_logp": logp0 + 0.3 * torch.randn(T, generator=gen),
        "advantages": torch.randn(T, generator=gen),
        "loss_mask": torch.rand(T, generator=gen) > 0.2,
        "lengths": torch.tensor(LENGTHS),
    }
    loss_kw["rollout_logp"] = loss_kw["old_logp"] + 0.2 * torch.randn(T, generator=gen)
    to = lambda t: t.to(device)  # noqa: E731
    return to(logits), to(ids), to(grad), {k: to(v) for k, v in loss_kw.items()}


def _compute(logits, ids, grad, loss_kw, temperature, tp_group):
    """(logp, dlogits of logp, loss, dlogits of loss) with our Triton ops."""
    from kernels.ops.grpo_loss import grpo_loss
    from kernels.ops.logp import logp

    x = logits.detach().clone().requires_grad_()
    out = logp(x, ids, temperature, tp_group=tp_group)
    out.backward(grad)
    y = logits.detach().clone().requires_grad_()
    loss, metrics = grpo_loss(y, ids, config=CONFIG, temperature=temperature, tp_group=tp_group, **loss_kw)
    loss.backward()
    return {"logp": out.detach().cpu(), "dlogits": x.grad.cpu(), "loss": loss.detach().cpu(),
            "dlogits_loss": y.grad.cpu(), **{k: v.cpu() for k, v in metrics.items()}}


def _tp_worker(rank: int, world: int, port: int, out_dir: str, backend: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    results = {}
    for i, temperature in enumerate((1.0, 0.7)):
        logits, ids, grad, loss_kw = _case_inputs(world, i, device)
        shard = logits[:, rank * V_LOCAL : (rank + 1) * V_LOCAL].contiguous()
        results[temperature] = _compute(shard, ids, grad, loss_kw, temperature, dist.group.WORLD)
        from kernels.reference import vocab_parallel_selected_logprob

        ref_in = shard.clone().requires_grad_()
        ref_out = vocab_parallel_selected_logprob(ref_in, ids, temperature, dist.group.WORLD)
        ref_out.backward(grad)
        results[temperature]["ref_logp"] = ref_out.detach().cpu()
        results[temperature]["ref_dlogits"] = ref_in.grad.cpu()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _check_tp2(tmp_path, backend: str, device: str, progress) -> None:
    world = 2
    with progress.step(f"{world} {backend} rank processes"):
        mp.spawn(_tp_worker, args=(world, _free_port(), str(tmp_path), backend), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    platform = "gpu" if device != "cpu" else "cpu"
    for i, temperature in enumerate((1.0, 0.7)):
        logits, ids, grad, loss_kw = _case_inputs(world, i, device)
        single = _compute(logits, ids, grad, loss_kw, temperature, None)
        full_grad = torch.cat([r[temperature]["dlogits"] for r in ranks], dim=1)
        full_grad_loss = torch.cat([r[temperature]["dlogits_loss"] for r in ranks], dim=1)
        ref_grad = torch.cat([r[temperature]["ref_dlogits"] for r in ranks], dim=1)
        for r in ranks:
            tolerances.assert_close(r[temperature]["logp"], single["logp"], "logp.tp2", torch.float32, platform)
            tolerances.assert_close(r[temperature]["ref_logp"], single["logp"], "logp.tp2", torch.float32, platform)
            for name in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss"):
                tolerances.assert_close(r[temperature][name], single[name], "logp.tp2", torch.float32, platform, name=name)
        tolerances.assert_close(full_grad, single["dlogits"], "logp.tp2.grad", torch.float32, platform, name="dlogits")
        tolerances.assert_close(ref_grad, single["dlogits"], "logp.tp2.grad", torch.float32, platform, name="ref dlogits")
        tolerances.assert_close(full_grad_loss, single["dlogits_loss"], "logp.tp2.grad", torch.float32, platform,
                                name="loss dlogits")
        assert float(single["pg_clipfrac"]) > 0 and float(single["kl_loss"]) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo/interpreter lane is the CPU lane")
def test_tp2_gloo_matches_tp1(tmp_path, rlk_progress):
    assert os.environ.get("TRITON_INTERPRET") == "1", "suites/op/conftest.py must set TRITON_INTERPRET on CPU"
    _check_tp2(tmp_path, "gloo", "cpu", rlk_progress)


@pytest.mark.gpus(2)
def test_tp2_nccl_matches_tp1(tmp_path, rlk_progress):
    _check_tp2(tmp_path, "nccl", "cuda:0", rlk_progress)
