"""What the operators take from PyTorch beyond its public API:

* vocab-parallel calls (the group passed by name) in real gloo processes, world size 1 and 2:
  fullgraph, the eager bits;
* the private PyTorch APIs the operators use (kernels/library/torch_internals.py) still work;
* torch.compile's on-disk caches carry the operators' tag, which follows their definitions.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kernels
import kernels.library  # registers torch.ops.rlk.*
from kernels.library import torch_internals
from suites.op.torch_library.cases import (
    BACKENDS,
    CONFIG,
    KERNELS_ON,
    SWITCHES,
    T,
    V,
    free_port,
    gen,
    inputs,
    run_with_grads,
)


# -- vocab-parallel calls: the group by name -------------------------------------------------------


def _tp_inputs(world: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's shard of a batch over a vocab of V * world: logits and LM-head rows (and bias)
    of columns [rank * V, (rank + 1) * V), the ids global (some on the other shards)."""
    full = {k: torch.cat([inputs(seed=10 + r)[k] for r in range(world)]) for k in ("weight", "bias")}
    x = inputs(seed=10)
    columns = slice(rank * V, (rank + 1) * V)
    x["logits"] = torch.cat([inputs(seed=10 + r)["logits"] for r in range(world)], dim=1)[:, columns].contiguous()
    x["weight"], x["bias"] = full["weight"][columns].contiguous(), full["bias"][columns].contiguous()
    x["ids"] = torch.randint(0, V * world, (T,), generator=gen(20))
    x["ids"][2] = -100
    return x


def _tp_step(x, group):
    """logp, linear_logp and the GRPO loss of this rank's shard over ``group``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    logp = kernels.logp(x["logits"], x["ids"], 0.7, tp_group=group)
    logp_h = kernels.linear_logp(x["hidden"], x["weight"], x["ids"], x["bias"], 0.9, tp_group=group,
                                 vocab_start=rank * V, global_vocab=world * V)
    loss, metrics = kernels.grpo_loss(x["logits"], x["ids"], old_logp=x["old_logp"], ref_logp=x["ref_logp"],
                                      advantages=x["advantages"], loss_mask=x["mask"], lengths=x["lengths"],
                                      config=CONFIG, temperature=0.9, tp_group=group)
    return loss, logp, logp_h, metrics["pg_clipfrac"]


def _tp_compiled_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Per backend: the graph breaks of the step over a new group and whether compiled == eager bitwise."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))  # not the default group: its name must resolve
    wrt = ("logits", "hidden", "weight", "bias")
    results = {}
    for backend in BACKENDS:
        for name in SWITCHES:
            os.environ.pop(name, None)
        if backend == "rlk-triton":
            os.environ.update(KERNELS_ON)

        def step(x):
            return _tp_step(x, group)

        x = _tp_inputs(world, rank)
        eager = run_with_grads(step, x, wrt)
        explanation = torch._dynamo.explain(step)(x)
        compiled = run_with_grads(torch.compile(step, fullgraph=True), x, wrt)
        torch._dynamo.reset()
        differ = [i for i, (u, v) in enumerate(zip(eager[0] + eager[1], compiled[0] + compiled[1], strict=True))
                  if not torch.equal(u, v)]
        results[backend] = {"breaks": explanation.graph_break_count, "reasons": str(explanation.break_reasons),
                            "differ": differ, "fallbacks": kernels.fallback_counts()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo/interpreter lane is the CPU lane")
# world 2 (two gloo ranks, slow on two cores) runs in tox -e tests; the quick start keeps world 1
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_vocab_parallel_calls_compile_fullgraph(world, tmp_path, rlk_progress):
    """logp, linear_logp and grpo_loss with a ``tp_group`` (passed to the operators by name):
    one graph, the eager outputs and gradients bitwise, on every rank, reference and rlk-triton."""
    with rlk_progress.step(f"{world} gloo rank process(es): eager vs torch.compile(fullgraph)"):
        mp.spawn(_tp_compiled_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for backend in BACKENDS:
            found = results[backend]
            assert found["breaks"] == 0, (rank, backend, found["reasons"])
            assert found["differ"] == [], f"rank {rank} {backend}: outputs/gradients {found['differ']} differ"
            assert found["fallbacks"] == {}, (rank, backend, found["fallbacks"])


# -- the private PyTorch APIs ------------------------------------------------------------------------

@torch.library.custom_op("rlk_test::sin_grad_inside", mutates_args=())
def _sin_grad_inside(x: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_()
    with torch_internals.autograd_inside():
        (grad,) = torch.autograd.grad(leaf.sin().sum(), leaf)
    return grad


def _process_group_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group([0])
    found = torch_internals.process_group(group.group_name)
    ok = found is not None and found.group_name == group.group_name and dist.get_world_size(found) == 1
    torch.save({"ok": ok, "none": torch_internals.process_group(None) is None}, os.path.join(out_dir, "found.pt"))
    dist.destroy_process_group()


def test_private_torch_apis_work(tmp_path):
    """Each private PyTorch API of kernels/library/torch_internals.py exists and does what the
    operators need; a PyTorch release that drops or changes one fails here, naming it."""
    for owner, name in ((torch._C, "_ForceDispatchKeyGuard"), (torch._C, "_dispatch_tls_local_exclude_set"),
                        (torch._C, "_dispatch_tls_local_include_set")):
        assert hasattr(owner, name), f"torch._C.{name} is gone: kernels/library/torch_internals.autograd_inside"
    import torch.distributed.distributed_c10d as c10d

    assert hasattr(c10d, "_resolve_process_group"), (
        "torch.distributed.distributed_c10d._resolve_process_group is gone: "
        "kernels/library/torch_internals.process_group")
    x = torch.randn(5)
    assert torch.equal(torch.ops.rlk_test.sin_grad_inside(x), x.cos()), "autograd_inside records nothing"
    mp.spawn(_process_group_worker, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    assert torch.load(tmp_path / "found.pt") == {"ok": True, "none": True}, "process_group(name) resolves wrong"


# -- torch.compile's on-disk caches ------------------------------------------------------------------

def test_the_operators_tag_the_compile_caches():
    """Importing the kernels appends the operators' digest to torch.compile's cache-key tag."""
    from kernels.library import compile_cache

    assert compile_cache.TAG == f"rlk-operators-{compile_cache.operators_digest()}"
    assert compile_cache.TAG in torch.compiler.config.cache_key_tag


def test_the_tag_follows_the_operators_definitions(tmp_path):
    from kernels.library import compile_cache

    for path in compile_cache.LIBRARY.glob("*.py"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    assert compile_cache.operators_digest(tmp_path) == compile_cache.operators_digest()
    changed = tmp_path / "grpo_loss.py"
    changed.write_text(changed.read_text() + "\n# another residual layout\n")
    assert compile_cache.operators_digest(tmp_path) != compile_cache.operators_digest()


def test_a_tag_the_user_set_is_kept():
    from kernels.library import compile_cache

    with torch.compiler.config.patch(cache_key_tag="mine"):
        assert compile_cache.tag_compile_caches() == f"mine|{compile_cache.TAG}"
        assert compile_cache.tag_compile_caches() == f"mine|{compile_cache.TAG}"  # added once


def test_another_tag_misses_the_on_disk_caches(tmp_path, monkeypatch):
    """What the tag is for: with this torch, a graph compiled under another tag (other operators)
    is not served from Inductor's or AOTAutograd's on-disk cache; under the same tag it is.

    On a GPU host the graph runs on CUDA: each cold compile is then a Triton kernel (seconds), not
    a C++ build (72 s for the two on a shared H100 host); the cache keys work the same way."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def compile_and_run() -> tuple[int, int]:
        torch.compiler.reset()
        counters.clear()
        x = torch.randn(8, requires_grad=True, device=device)
        torch.compile(lambda t: (t * 2).sin().sum(), fullgraph=True)(x).backward()
        return counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"]

    assert compile_and_run() == (0, 0)
    assert compile_and_run() != (0, 0)  # served from the cache under the same tag
    with torch.compiler.config.patch(cache_key_tag=torch.compiler.config.cache_key_tag + "|other-operators"):
        assert compile_and_run() == (0, 0)
    torch.compiler.reset()
