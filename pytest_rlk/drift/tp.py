"""The ``tp2`` layout: the LM head and the log-softmax vocab-parallel over real ranks.

Two processes (``torch.multiprocessing.spawn``) form the tensor-parallel group, with megatron-core's
``parallel_state`` when it is installed (else the world group): NCCL when the machine has a GPU
per rank, else gloo on CPU tensors. Each rank holds its LM-head shard ``[rank * V_local,
(rank + 1) * V_local)``, computes its logits shard from the SAME final hidden states as the TP=1
forward (the padded micro-batch, so the head's matmul has the TP=1 shape but for the vocab split)
and runs each requested arithmetic over the group. Rank 0 writes the log-probs; a side that raises
is reported with its error, never dropped.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pytest_rlk.drift.arith import SideUnavailable, logp_from_logits


def tp_backend(world: int) -> str:
    """``nccl`` with a GPU per rank, ``gloo`` (CPU tensors) on a CPU-only host."""
    if torch.cuda.is_available():
        if torch.cuda.device_count() >= world:
            return "nccl"
        raise SideUnavailable(f"TP={world} needs {world} GPUs for NCCL (found {torch.cuda.device_count()})")
    return "gloo"


def run_tp(*, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor,
           ids: torch.Tensor, temperature: float, ariths: list[str], world: int = 2) -> dict[str, object]:
    """{arith: fp32 log-probs [R] on CPU, or ``("unavailable" | "error", reason)``; ``arith + "_impl"``:
    the implementation's id} plus ``"_backend"`` (the process group's).

    hidden: [B, L, H] (the micro-batch's final hidden states); weight: [V, H]; rows: [R] flat indices
    into ``B * L`` of the response positions; ids: [R] global target ids.
    """
    vocab = weight.shape[0]
    if vocab % world:
        raise SideUnavailable(f"TP={world}: the vocab {vocab} does not split evenly over {world} ranks")
    backend = tp_backend(world)
    with tempfile.TemporaryDirectory(prefix="rlk-drift-tp-") as tmp:
        work = Path(tmp)
        torch.save({"hidden": hidden.detach().cpu(), "weight": weight.detach().cpu(),
                    "bias": None if bias is None else bias.detach().cpu(), "rows": rows.cpu(), "ids": ids.cpu(),
                    "temperature": float(temperature)}, work / "inputs.pt")
        mp.spawn(_worker, args=(world, str(work / "init"), backend, str(work), list(ariths), torch.get_num_threads()),
                 nprocs=world, join=True)
        out = torch.load(work / "rank0.pt")
    out["_backend"] = backend
    return out


def _worker(rank: int, world: int, init_file: str, backend: str, work_dir: str, ariths: list[str],
            threads: int) -> None:
    torch.set_num_threads(threads)  # the parent's: CPU matmuls may sum in another order with another count
    # megatron-core warns once per module that Transformer Engine / Apex are absent; nothing here uses them
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    parallel_state = None
    try:
        try:
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(world, 1)
            group = parallel_state.get_tensor_model_parallel_group()
        except ImportError:
            parallel_state = None
            group = dist.group.WORLD
        inputs = torch.load(Path(work_dir) / "inputs.pt")
        v_local = inputs["weight"].shape[0] // world
        shard = slice(rank * v_local, (rank + 1) * v_local)
        weight = inputs["weight"][shard].to(device)
        bias = None if inputs["bias"] is None else inputs["bias"][shard].to(device)
        hidden = inputs["hidden"].to(device)
        logits = torch.nn.functional.linear(hidden, weight, bias)
        rows = logits.reshape(-1, v_local)[inputs["rows"].to(device)]
        ids = inputs["ids"].to(device)
        out: dict[str, object] = {}
        for arith in ariths:
            try:
                if arith == "megatron" and parallel_state is None:
                    raise SideUnavailable("megatron-core is not installed")
                logp, impl = logp_from_logits(arith, rows, ids, inputs["temperature"], tp_group=group)
                out[arith] = logp.cpu()
                out[f"{arith}_impl"] = impl
            except SideUnavailable as exc:
                out[arith] = ("unavailable", str(exc))
            except Exception as exc:  # the parent raises it as this side's failure
                out[arith] = ("error", f"{type(exc).__name__}: {exc}")
        if rank == 0:
            torch.save(out, Path(work_dir) / "rank0.pt")
        dist.barrier(group=group)
    finally:
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
