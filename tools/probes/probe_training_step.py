"""Where a training step's time goes, stage by stage and op by op (GPU; a script, not a test).

    python tools/probes/probe_training_step.py [--arms reference,kernels] [--case gpu|tiny] [--out DIR]

The 0.6B-sized step of test_training_step.py (GPU_CASE: bf16 weights, fp32 logits [2048, 151936],
vime's loss with KL and TIS; ``--case tiny``: its tiny dense case, which runs on a CPU too), each
arm as the test runs it. After two warm-up steps, one step per
arm runs under ``torch.profiler`` (CPU and CUDA), with each stage of ``train_step.train`` and of
the vime adapter named by ``record_function``. Printed per arm: each step stage's wall time (host,
synchronized at its ends) and the adapter's own stage times (its ``rlk_*_ms`` metrics), each
range's host time and the GPU time of the kernels it launched, and the ops that take most of
either; with ``--out``, a Chrome trace per arm and the figures as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.integrations import vime as adapter  # noqa: E402
from suites.module import tiny, train_step  # noqa: E402
from suites.module import vime_standin as standin  # noqa: E402
from suites.module.loss_cases import batch_to  # noqa: E402
from suites.module.test_training_step import GPU_CASE, LOSS_FLAGS, SEED, TINY_CASES, _prompts  # noqa: E402

ARMS = {"reference": "reference", "kernels": "rlk-triton"}


@contextlib.contextmanager
def _named_stages():
    """The adapter's StageTimer stages as profiler ranges too (the probe's view; the timer is unchanged)."""
    stage = adapter.StageTimer.stage

    @contextlib.contextmanager
    def profiled(self, name):
        with torch.profiler.record_function(name), stage(self, name):
            yield

    adapter.StageTimer.stage = profiled
    try:
        yield
    finally:
        adapter.StageTimer.stage = stage


def _step(model, batch, args, sosm, optimizer, walls: dict[str, float]) -> None:
    """train_step.one_step, each stage a profiler range ``step.<name>`` timed as the training step
    times it, and the adapter's own stage times per call."""
    synced = train_step.synced_timer(next(model.parameters()).device, walls)

    def timed(name, fn):
        def profiled():
            with torch.profiler.record_function(f"step.{name}"):
                return fn()

        return synced(name, profiled)

    _, metrics, _ = train_step.one_step(model, batch, args, sosm, optimizer, timed)
    walls.update(train_step.adapter_stage_ms(args, batch, metrics))


def _ranges(prof) -> dict[str, dict[str, float]]:
    """Per record_function range: its host time and the GPU time of the kernels launched inside it."""
    out: dict[str, dict[str, float]] = {}
    for event in prof.key_averages():  # a range appears twice with CUDA on: its host and its device row
        if event.key.startswith(("step.", "rlk_")):
            row = out.setdefault(event.key, {"cpu_ms": 0.0, "gpu_ms": 0.0})
            row["cpu_ms"] = max(row["cpu_ms"], event.cpu_time_total / 1e3)
            row["gpu_ms"] = max(row["gpu_ms"], event.device_time_total / 1e3)
    return out


def _top_ops(prof, limit: int) -> dict[str, list[tuple[str, float, int]]]:
    by_gpu, by_cpu = defaultdict(float), defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        if event.key.startswith(("step.", "rlk_", "ProfilerStep")):
            continue
        by_gpu[event.key] += event.self_device_time_total / 1e3
        by_cpu[event.key] += event.self_cpu_time_total / 1e3
        counts[event.key] += event.count

    def pick(totals: dict[str, float]) -> list[tuple[str, float, int]]:
        return [(k, round(v, 3), counts[k]) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:limit]]

    return {"gpu": pick(by_gpu), "cpu": pick(by_cpu)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="reference,kernels")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--case", choices=("gpu", "tiny"), default="gpu")
    parser.add_argument("--top", type=int, default=15)
    opts = parser.parse_args()
    if opts.case == "gpu" and not torch.cuda.is_available():
        print("--case gpu needs a GPU (--case tiny runs here)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if opts.case == "gpu" else "cpu")
    case = GPU_CASE if opts.case == "gpu" else TINY_CASES["dense"]
    base = tiny.build_model(case.kind, seed=SEED, vocab_size=case.vocab_size, size=case.size, dtype=case.dtype,
                            device=device)
    rollout = train_step.sample_rollout(base, _prompts(case.n_prompts, case.vocab_size),
                                        group_size=case.group_size, response_len=case.response_len, seed=SEED)
    batch = batch_to(train_step.vime_batch(base, rollout), device)
    args = standin.vime_args_standin(LOSS_FLAGS)
    sosm = standin.sum_of_sample_mean_standin(batch["response_lengths"], batch["loss_masks"],
                                              args.calculate_per_token_loss)
    report = {}
    os.environ.update(VIME_RL_KERNEL="1", VIME_RL_KERNEL_STRICT="1")
    for arm in opts.arms.split(","):
        os.environ["VIME_RL_KERNEL_BACKEND"] = ARMS[arm]
        model = tiny.build_model(case.kind, seed=SEED, vocab_size=case.vocab_size, size=case.size,
                                 dtype=case.dtype, device=device)
        model.load_state_dict(base.state_dict())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
        walls: dict[str, float] = {}
        with _named_stages():
            for _ in range(2):
                _step(model, batch, args, sosm, optimizer, walls)
            warm = dict(walls)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                _step(model, batch, args, sosm, optimizer, walls)
        if opts.out:
            opts.out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(opts.out / f"trace-{arm}.json"))
        report[arm] = {"wall_ms_unprofiled": warm, "wall_ms_profiled": walls, "ranges": _ranges(prof),
                       "top_ops": _top_ops(prof, opts.top)}
        print(f"== {arm}")
        print("wall ms (unprofiled step 2): " + ", ".join(f"{k} {v:.2f}" for k, v in warm.items()))
        for name, r in sorted(report[arm]["ranges"].items()):
            print(f"  {name:24s} host {r['cpu_ms']:9.3f} ms   gpu {r['gpu_ms']:9.3f} ms")
        for kind in ("gpu", "cpu"):
            print(f"  top ops by self {kind} ms:")
            for key, ms, count in report[arm]["top_ops"][kind]:
                print(f"    {ms:9.3f}  x{count:<5d} {key[:100]}")
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if opts.out:
        (opts.out / "probe_training_step.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
