"""Launch configurations and code variants of the one-read GRPO kernel, timed on this GPU (a script, not a test).

    python tools/probes/probe_grpo_one_read_config.py --out DIR [--variants REGEX] [--dtypes bf16,fp32]
        [--rounds N] [--ncu VARIANT,...] [--baseline-source OLD.cu] [--tests VARIANT]

Each variant is a set of ``-D`` macros of kernels/ops/cuda/grpo_loss_one_read.cu (RLK_THREADS,
RLK_MIN_CTAS, RLK_STAGES, RLK_BULK_LOAD) plus the host cut's slice cap (which picks the
cluster size); ``baseline`` is an earlier copy of the source (``--baseline-source``, e.g.
``git show main:kernels/ops/cuda/grpo_loss_one_read.cu > /tmp/old.cu``). All fatbins are built
first, in parallel (build.py's cache). Then, at the
benchmark shape [8192, 151936] and vime's loss as bench_grpo_loss.py runs it, in interleaved
rounds (every variant once per round, so drifting clocks hit all alike), per variant and dtype:

* ``kernel_ms``: the kernel alone, 20 back-to-back launches between CUDA events, per launch;
* ``graph_ms``: the op's forward+backward (``kernels.grpo_loss`` then ``torch.autograd.grad``)
  as one CUDA-graph replay (GPU time, no host time);
* ``plain_ms``: the same call plainly (wall time, pytest_rlk.timing.bench);

each the median over rounds, against the one-read limit (one read of the logits and one write of
dlogits at the copy bandwidth measured in the same process). Before timing, every variant but the
default runs once in a child process of its own, all at once: a variant that does not build, fails
or does not finish in time is dropped (with why, in probe.json) and the probe goes on; the
registers, stack and shared memory of the benchmark shape's kernels are printed (cuobjdump). The op runs its Python path (the C++
host path keeps one kernel per key; at this shape the host time is hidden behind the GPU's). Every
variant's dlogits and per-token outputs are compared with the default variant's (elements that
differ, the largest difference in units of the output dtype's spacing). ``--ncu`` profiles the
kernel alone for the named variants (``ncu --clock-control none``, the sections of docs/ncu.md);
``--tests VARIANT`` (a run of its own, after the probe) runs the one-read tests of
suites/op/test_grpo_loss.py with that variant's build (``best``: the fastest bf16 op of
DIR/probe.json). Results: DIR/probe.json, DIR/probe.md (a table), DIR/ncu_<variant>_<dtype>.csv.
Measured results and commands: docs/performance-notes.md ("bulk copies and lean sweeps", "a persistent
grid of clusters").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "suites" / "op"  # rlk_bench and the bench modules
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
os.environ.setdefault("VIME_RL_KERNEL", "1")
os.environ.setdefault("VIME_RL_KERNEL_CHECK_IDS", "0")  # no host sync: the op is captured in a CUDA graph

import torch

from kernels.ops.cuda import build
from kernels.ops.cuda import grpo_loss_one_read as one_read

SHAPE = (8192, 151936)
KIB = 1024


@dataclass(frozen=True)
class Variant:
    defines: tuple[str, ...] = ()
    slice_bytes: int = one_read.SLICE_BYTES
    dtypes: tuple[str, ...] = ("bf16", "fp32")
    baseline: bool = False  # built from --baseline-source (an earlier grpo_loss_one_read.cu), not SOURCE
    notes: str = field(default="", compare=False)

    def threads(self) -> int:
        for d in self.defines:
            if d.startswith("RLK_THREADS="):
                return int(d.split("=")[1])
        return SOURCE_THREADS

    def source(self) -> Path:
        if not self.baseline:
            return SOURCE
        if BASELINE_SOURCE is None:
            raise SystemExit("variant 'baseline' needs --baseline-source PATH")
        return BASELINE_SOURCE


SOURCE = one_read.SOURCE
SOURCE_THREADS = one_read.THREADS  # RLK_THREADS's default in the source
BASELINE_SOURCE: Path | None = None


def _v(*defines: str, slice_kib: int = 96, dtypes=("bf16", "fp32"), baseline: bool = False, notes: str = "") -> Variant:
    return Variant(tuple(defines), slice_kib * KIB, tuple(dtypes), baseline, notes)


# name -> variant; "default" is the source as it stands (the reference for the output comparison).
# Measured and dropped (docs/performance-notes.md): 1024 threads, 48 KiB slices, 8 stages, an FMA-pipe
# polynomial for part of the exps, each stage's max first, bulk stores of dlogits from shared memory.
VARIANTS: dict[str, Variant] = {
    "default": _v(notes="the source's defaults"),
    "baseline": _v(baseline=True, notes="--baseline-source with its defaults"),
    "cp_async": _v("RLK_BULK_LOAD=0", notes="per-thread 16-byte cp.async instead of bulk copies"),
    "stages2": _v("RLK_STAGES=2"),
    "t256": _v("RLK_THREADS=256"),
    "t256_c4": _v("RLK_THREADS=256", "RLK_MIN_CTAS=4", dtypes=("bf16",)),
    "min2": _v("RLK_MIN_CTAS=2", notes="registers capped for 2 CTAs (shared memory still fits 3)"),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def defines_of(variant: Variant) -> tuple[str, ...]:
    """The -D macros as grpo_loss_one_read.launch passes them (THREADS apart, EXTRA_DEFINES the rest)."""
    threads = variant.threads()
    extra = tuple(d for d in variant.defines if not d.startswith("RLK_THREADS="))
    return (() if threads == 512 else (f"RLK_THREADS={threads}",)) + extra


def use(variant: Variant) -> None:
    """Make the host side launch ``variant`` (module constants; the plan cache cleared)."""
    one_read.SOURCE = variant.source()
    one_read.THREADS = variant.threads()
    one_read.EXTRA_DEFINES = tuple(d for d in variant.defines if not d.startswith("RLK_THREADS="))
    one_read.SLICE_BYTES = variant.slice_bytes
    one_read._plan.cache_clear()


def build_all(names: list[str]) -> dict[str, float | str]:
    """Compile every variant's fatbin (in parallel; cached); seconds per variant, or the error."""
    def one(name):
        start = time.perf_counter()
        try:
            build.compile_fatbin(VARIANTS[name].source(), defines_of(VARIANTS[name]))
        except build.CudaBuildError as exc:
            print(f"[probe] variant {name} does not build: {exc}", flush=True)
            return name, f"build failed: {str(exc)[-600:]}"
        return name, time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        return dict(pool.map(one, names))


def smoke(names: list[str], dtypes: list[str], timeout_s: float = 150, at_once: int = 4) -> dict[str, str]:
    """Run each variant's kernel (--single, every dtype) in a child process of its own, ``at_once`` at a
    time (each holds the benchmark's logits and dlogits: up to 10 GB at fp32); the variants that fail or
    hang (a kernel that never finishes would hold the whole probe), with why."""
    failed = {}
    for first in range(0, len(names), at_once):
        procs = {}
        for name in names[first:first + at_once]:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--single", f"{name}:{','.join(dtypes)}",
                   *(["--baseline-source", str(BASELINE_SOURCE)] if BASELINE_SOURCE else [])]
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout_s
        for name, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                failed[name] = f"did not finish in {timeout_s:.0f} s"
            else:
                if proc.returncode != 0:
                    failed[name] = f"exit {proc.returncode}: {out[-1500:]}"
    for name, why in failed.items():
        print(f"[probe] variant {name} dropped: {why}", flush=True)
    return failed


def resource_usage(names: list[str]) -> None:
    """Registers, stack and shared memory of the benchmark shape's kernels (cuobjdump, where present)."""
    tool = shutil.which("cuobjdump") or next((str(p) for p in sorted(Path("/").glob("usr/local/cuda*/bin/cuobjdump"))),
                                             None)
    if tool is None:
        return
    for name in names:
        fatbin = build.fatbin_path(VARIANTS[name].source(), defines_of(VARIANTS[name]))
        proc = subprocess.run([tool, "-res-usage", str(fatbin)], capture_output=True, text=True, check=False)
        lines = proc.stdout.splitlines()
        for i, line in enumerate(lines):
            if re.search(r"grpo_one_read_(bf16_c[48]|fp32_c8)\b", line) and i + 1 < len(lines):
                print(f"[res {name}] {line.split()[-1]} {lines[i + 1].strip()}", flush=True)


def _python_path_only() -> contextlib.AbstractContextManager[None]:
    """The op's Python path while inside, registering nothing: the C++ host path holds one kernel
    per key and would refuse a second variant under the same key."""
    from kernels.ops import grpo_loss as grpo_loss_op

    return grpo_loss_op._HOST.off(register=False)


class Workload:
    """The benchmark's inputs for one dtype and the kernel's own arguments."""

    def __init__(self, dtype: torch.dtype) -> None:
        from bench_grpo_loss import CONFIG, _inputs

        from kernels import device_errors

        self.config = CONFIG
        self.logits, self.ids, self.kw = _inputs(*SHAPE, dtype)
        self.logits.requires_grad_()
        num_tokens = SHAPE[0]
        self.grad = torch.empty_like(self.logits, requires_grad=False)
        self.per_token = torch.empty(7, num_tokens, device="cuda")
        self.weights = torch.full((num_tokens,), 1.0 / num_tokens, device="cuda")
        self.word = device_errors.word_for(self.logits.device)

    def launch(self) -> None:
        plan = one_read.plan(self.logits)
        assert isinstance(plan, one_read.OneReadPlan), plan
        kw = self.kw
        one_read.launch(plan, self.logits.detach(), self.grad, self.ids, kw["old_logp"], kw["ref_logp"],
                        kw["advantages"], None, self.weights, self.per_token, self.config, 1.0, -100, 3,
                        self.word.ptr, 1)

    def op(self) -> None:
        import kernels

        loss = kernels.grpo_loss(self.logits, self.ids, config=self.config, **self.kw)[0]
        torch.autograd.grad(loss, self.logits)


def kernel_ms(work: Workload, launches: int = 20) -> float:
    work.launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        work.launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / launches


def compare(actual: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """dlogits and per-token outputs against the default variant's."""
    from kernels.tolerances import spacing

    grad, per_token = actual
    ref_grad, ref_per_token = reference
    differ = 0
    max_units = 0.0
    for a, e in zip(grad.split(512), ref_grad.split(512)):  # in row blocks: no fp32 copy of the whole
        d = (a.float() - e.float()).abs()
        differ += int((d > 0).sum())
        max_units = max(max_units, float((d / spacing(e.float(), e.dtype)).max()))
    rel = (per_token - ref_per_token).abs() / ref_per_token.abs().clamp(min=1e-30)
    return {"dlogits_elements_differing": differ, "dlogits_max_spacings": max_units,
            "per_token_max_rel": {name: float(rel[i].max()) for i, name in
                                  enumerate(["pg", "clipped", "old_minus_logp", "kl", "coef", "max", "sumexp"])}}


def probe(names: list[str], dtypes: list[str], rounds: int) -> dict:
    from rlk_bench import graph_replay_ms, hbm_bytes_per_s

    from pytest_rlk import timing

    copy = hbm_bytes_per_s()
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": list(SHAPE),
                     "copy_bytes_per_s": copy, "rounds": rounds, "cases": {}}
    for dn in dtypes:
        work = Workload(DTYPES[dn])
        limit_ms = 2 * work.logits.numel() * work.logits.element_size() / copy * 1e3
        chosen = [n for n in names if dn in VARIANTS[n].dtypes]
        samples: dict[str, dict[str, list[float]]] = {n: {"kernel_ms": [], "graph_ms": [], "plain_ms": []}
                                                      for n in chosen}
        reference = None
        checks = {}
        for name in chosen:  # outputs first (also warms every module up)
            use(VARIANTS[name])
            work.launch()
            torch.cuda.synchronize()
            out = (work.grad.clone(), work.per_token.clone())
            if reference is None:
                reference = out
            checks[name] = compare(out, reference)
            del out
        reference = None
        torch.cuda.empty_cache()
        for r in range(rounds):
            order = chosen if r % 2 == 0 else chosen[::-1]
            for name in order:
                use(VARIANTS[name])
                samples[name]["kernel_ms"].append(kernel_ms(work))
                graph, why = graph_replay_ms(work.op)
                if graph is not None:
                    samples[name]["graph_ms"].append(graph)
                else:
                    checks[name]["graph_capture"] = why
                samples[name]["plain_ms"].append(timing.bench(work.op, device="cuda").median_ms)
            print(f"[probe] {dn} round {r + 1}/{rounds} done", flush=True)
        for name in chosen:
            row = {k: statistics.median(v) if v else None for k, v in samples[name].items()}
            row.update({f"{k}_all": v for k, v in samples[name].items()})
            row["pct_of_limit"] = {k: 100 * limit_ms / row[k] for k in ("kernel_ms", "graph_ms", "plain_ms")
                                   if row[k]}
            row["defines"] = list(VARIANTS[name].defines)
            row["slice_bytes"] = VARIANTS[name].slice_bytes
            use(VARIANTS[name])
            plan = one_read.plan(work.logits)
            row["plan"] = f"C={plan.cluster} slice={plan.slice} threads={one_read.THREADS} smem={plan.shared_bytes}"
            row.update(checks[name])
            results["cases"][f"{name}/{dn}"] = row
        results[f"limit_ms_{dn}"] = limit_ms
        del work
        torch.cuda.empty_cache()
    use(VARIANTS["default"])
    return results


def table(results: dict) -> str:
    lines = [(f"# one-read kernel variants on {results['device']} ({results['shape']}, median of "
             f"{results['rounds']} rounds; copy {results['copy_bytes_per_s'] / 1e12:.2f} TB/s)"), "",
             ("| variant / dtype | plan | kernel ms (% limit) | op graph ms (%) | op plain ms (%) | dlogits differing "
             "/ max spacings vs default | per-token max rel (sumexp, pg) |"), "|---|---|---|---|---|---|---|"]
    for key, row in results["cases"].items():
        pct = row["pct_of_limit"]

        def cell(k, row=row, pct=pct):
            return f"{row[k]:.4f} ({pct[k]:.1f}%)" if row.get(k) else "-"
        rel = row["per_token_max_rel"]
        lines.append(f"| {key} | {row['plan']} | {cell('kernel_ms')} | {cell('graph_ms')} | {cell('plain_ms')} | "
                     f"{row['dlogits_elements_differing']} / {row['dlogits_max_spacings']:.2g} | "
                     f"{rel['sumexp']:.2g}, {rel['pg']:.2g} |")
    return "\n".join(lines) + "\n"


def single(name: str, dtypes: str) -> None:
    """One variant's kernel, launched 3 times per dtype (for ncu: it profiles the last; for smoke)."""
    use(VARIANTS[name])
    for dn in dtypes.split(","):
        if dn not in VARIANTS[name].dtypes:
            continue
        work = Workload(DTYPES[dn])
        for _ in range(3):
            work.launch()
        torch.cuda.synchronize()
        del work
        torch.cuda.empty_cache()


NCU_SECTIONS = ["SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "ComputeWorkloadAnalysis",
                "WarpStateStats", "SchedulerStats", "InstructionStats"]
NCU_METRICS = ("gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,"
               "dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,"
               "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,"
               "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,"
               "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,"
               "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,"
               "smsp__issue_active.avg.pct_of_peak_sustained_active")


def run_ncu(names: list[str], dn: str, out: Path) -> None:
    ncu = shutil.which("ncu") or next((str(p) for p in sorted(Path("/").glob("usr/local/cuda*/bin/ncu"))), None)
    if ncu is None:
        print("[probe] ncu not found: no profile", flush=True)
        return
    for name in names:
        cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--kernel-name", "regex:grpo_one_read",
               "--launch-skip", "2", "--launch-count", "1", *(a for s in NCU_SECTIONS for a in ("--section", s)),
               "--metrics", NCU_METRICS, "--csv", "--page", "details",
               sys.executable, str(Path(__file__).resolve()), "--single", f"{name}:{dn}",
               *(["--baseline-source", str(BASELINE_SOURCE)] if BASELINE_SOURCE else [])]
        print("[probe] $ " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
        (out / f"ncu_{name}_{dn}.csv").write_text(proc.stdout + proc.stderr[-3000:])
        keep = re.compile(r"Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Executed Ipc Active|"
                          r"Achieved Occupancy|Registers Per|dram__bytes|pipe_xu|pipe_fma|pipe_lsu|pipe_alu|"
                          r"issue_active|inst_executed.sum|No Eligible|Stall|Theoretical Occupancy|Block Limit")
        for line in proc.stdout.splitlines():
            if keep.search(line):
                cols = [c.strip('"') for c in line.split('","')]
                print(f"[ncu {name} {dn}] " + " | ".join(cols[-4:]), flush=True)


def run_tests(name: str) -> int:
    import pytest

    use(VARIANTS[name])
    return pytest.main(["suites/op/test_grpo_loss.py", "-k", "one_read", "--rlk-tier=op", "-q", "-p",
                        "no:cacheprovider"])


def fastest(results: dict) -> str:
    """The variant whose bf16 op replays fastest."""
    bf16 = {k.split("/")[0]: v["graph_ms"] for k, v in results["cases"].items() if k.endswith("/bf16") and v["graph_ms"]}
    return min(bf16, key=bf16.get) if bf16 else "default"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("probe-one-read"))
    ap.add_argument("--variants", default=".", help="regex over variant names (default is always included; "
                    "baseline only with --baseline-source)")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ncu", default="", help="comma list of variants to profile (bf16), 'best' for the fastest")
    ap.add_argument("--tests", default="", help="only run the one-read tests with this variant ('best': the "
                    "fastest bf16 op in OUT/probe.json)")
    ap.add_argument("--single", help=argparse.SUPPRESS)  # VARIANT:DTYPE, the ncu child
    ap.add_argument("--baseline-source", type=Path, help="an earlier grpo_loss_one_read.cu (variant 'baseline')")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    global BASELINE_SOURCE
    BASELINE_SOURCE = args.baseline_source.resolve() if args.baseline_source else None
    if args.list:
        for name, v in VARIANTS.items():
            print(name, "baseline" if v.baseline else "", " ".join(defines_of(v)), f"slice<={v.slice_bytes}",
                  ",".join(v.dtypes), v.notes)
        return
    if args.single:
        name, dn = args.single.split(":")
        single(name, dn)
        return
    if args.tests:
        name = fastest(json.loads((args.out / "probe.json").read_text())) if args.tests == "best" else args.tests
        print(f"[probe] one-read tests with variant {name}: {' '.join(VARIANTS[name].defines) or 'as the source'}",
              flush=True)
        raise SystemExit(run_tests(name))
    names = ["default"] + [n for n in VARIANTS if n != "default" and re.search(args.variants, n)
                           and (BASELINE_SOURCE is not None or not VARIANTS[n].baseline)]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    built = build_all(names)
    print(f"[probe] built {len(built)} variants in {time.perf_counter() - start:.1f} s", flush=True)
    resource_usage([n for n in names if not isinstance(built[n], str)])
    dropped = {n: why for n, why in built.items() if isinstance(why, str)}
    dropped.update(smoke([n for n in names if n != "default" and n not in dropped], args.dtypes.split(",")))
    if "default" in dropped:
        raise SystemExit(f"the default variant does not build: {dropped['default']}")
    with _python_path_only():
        results = probe([n for n in names if n not in dropped], args.dtypes.split(","), args.rounds)
    results["build_s"] = built
    results["dropped"] = dropped
    (args.out / "probe.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (args.out / "probe.md").write_text(text)
    print(text, flush=True)
    best = fastest(results)
    print(f"[probe] fastest bf16 op (graph replay): {best}", flush=True)
    ncu_names = [best if n == "best" else n for n in args.ncu.split(",") if n]
    if ncu_names:
        run_ncu(list(dict.fromkeys(ncu_names)), "bf16", args.out)


if __name__ == "__main__":
    main()
