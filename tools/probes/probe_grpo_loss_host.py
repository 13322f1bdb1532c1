"""Host time of a launch-bound grpo_loss call, part by part (GPU; a script, not a test).

    python tools/probes/probe_grpo_loss_host.py [--out FILE.json] [--profile]

Public call (``kernels.grpo_loss`` with ``VIME_RL_KERNEL=1``) at [64, 151936] bf16, vime's loss as
the benchmarks run it: forward alone, backward alone (``torch.autograd.grad`` of a fresh forward's
loss), forward+backward, on the C++ host path and with it off (the Python path), and beside them
yardsticks in this process: a trivial ``torch.autograd.grad((x * 2).sum(), x)`` (two recorded ops
and a Python-side ``grad``: a one-node call can come in under it), ``torch.empty(64)``, the
contract and dispatch alone, the C++ forward alone. The paths take turns
block by block (the host's speed drifts); each figure is the lowest block median (us per call).
Then the C++ module's own clock per phase (``phases``), and with ``--profile`` cProfile of the
public fwd+bwd on the host path (the Python left in it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "suites" / "op"))  # bench_grpo_loss, rlk_bench
os.environ["VIME_RL_KERNEL"] = "1"

from bench_grpo_loss import CONFIG, _inputs  # the benchmark's inputs and loss
from rlk_bench import host_overhead_blocks_us

import kernels
from kernels import dispatch
from kernels.contracts import GrpoLossCall
from kernels.ops import grpo_loss as grpo_loss_op


def _lowest(fn, calls: int, blocks: int) -> float:
    return min(host_overhead_blocks_us(fn, calls=calls, blocks=blocks, pause_s=0.0))


def _backward_alone_us(forward, logits, calls: int, blocks: int) -> float:
    """Median host time of ``torch.autograd.grad`` alone, each on a fresh forward's loss (untimed)."""
    medians = []
    for _ in range(blocks):
        spans = []
        for i in range(calls):
            loss = forward()
            start = time.perf_counter()
            torch.autograd.grad(loss, logits)
            spans.append(time.perf_counter() - start)
            if i % 50 == 49:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        medians.append(statistics.median(spans) * 1e6)
    return min(medians)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=4, help="rounds in which the paths take turns")
    args = parser.parse_args()
    calls, blocks = args.calls, args.blocks
    logits, ids, kw = _inputs(64, 151936, torch.bfloat16)
    logits.requires_grad_()

    def forward():
        return kernels.grpo_loss(logits, ids, config=CONFIG, **kw)[0]

    def forward_backward():
        return torch.autograd.grad(forward(), logits)

    for _ in range(3):
        forward_backward()
    torch.cuda.synchronize()
    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "shape": "64x151936 bf16", "host_path": grpo_loss_op.host_path()}
    module = grpo_loss_op._HOST.load()
    x = torch.zeros(64, device="cuda", requires_grad=True)
    call = GrpoLossCall(logits, ids, config=CONFIG, **kw)
    probes = {
        "fwd_us": lambda: _lowest(forward, calls, 1),
        "bwd_us": lambda: _backward_alone_us(forward, logits, calls, 1),
        "fwd_bwd_us": lambda: _lowest(forward_backward, calls, 1),
    }
    # the host's speed comes in regimes that last seconds: the paths take turns, block by block, and
    # each figure is its lowest block
    for _ in range(blocks):
        for path in ("c++", "python"):
            # the Python path alone: no host path, and no registration (which would turn it back on)
            with grpo_loss_op._HOST.off() if path == "python" else contextlib.nullcontext():
                before = module.served()
                for name, probe in probes.items():
                    key = f"{path}_{name}"
                    results[key] = min(results.get(key, float("inf")), probe())
                served_here = f"{path}_blocks_served_by_cpp"
                results[served_here] = results.get(served_here, 0) + module.served() - before
        for key, fn in (("floor_autograd_grad_us", lambda: torch.autograd.grad((x * 2).sum(), x)),
                        ("floor_empty_us", lambda: torch.empty(64, device="cuda")),
                        ("contract_us", lambda: GrpoLossCall(logits, ids, config=CONFIG, **kw)),
                        ("dispatch_select_us", lambda: dispatch.select("grpo_loss", **call.case())),
                        ("cpp_forward_alone_us", lambda: module.forward(call))):
            results[key] = min(results.get(key, float("inf")), _lowest(fn, calls, 1))
    module.phases(True)
    for i in range(calls):
        forward_backward()
        if i % 100 == 99:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    results["cpp_phases_us"] = {k: round(v, 2) for k, v in module.phases(False).items()}
    for key, value in results.items():
        print(f"{key}: {value:.1f}" if isinstance(value, float) else f"{key}: {value}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for i in range(2000):
            forward_backward()
            if i % 100 == 99:
                torch.cuda.synchronize()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
