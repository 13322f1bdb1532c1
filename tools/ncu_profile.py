"""ncu profile of our kernels at the benchmark shapes: on a GPU machine ``python3 tools/ncu_profile.py --ncu OUT``.

See docs/ncu.md for the results and the exact command.

Not a test (pytest collects test_*.py / bench_*.py only). Three modes:

* workload (no ``--ncu``): builds each case's inputs like the benchmarks (suites/op: bench_logp.py,
  bench_grpo_loss.py, bench_ratio_kl.py, bench_linear_logp.py: same shapes, seeds, LossConfig),
  warms the op up (compiles), runs the unprofiled part (e.g. the forward of a backward case), then
  the profiled part once between ``cudaProfilerStart``/``Stop`` inside ``torch.cuda.nvtx.range(case)``,
  so ``ncu --profile-from-start off --nvtx`` sees only those launches, labelled by case.
  ``--cases REGEX`` picks cases; ``--small`` uses tiny shapes (CPU: ``TRITON_INTERPRET=1``) to check
  the script without a GPU; ``--list`` prints the case names.
* ``--ncu OUT_DIR``: runs ncu on this script once per case group (memory-bound ops, linear_logp
  forward, linear_logp backward limited to its first chunks), exporting a report per group, then the
  raw and details CSV pages, and writes ``OUT_DIR/summary.md`` (one row per profiled kernel).
* ``--summarize OUT_DIR``: only the last step, from the ``*_raw.csv`` files already there.

One script of ~550 lines on purpose: ncu profiles this very file as its application (``--ncu``
re-runs it per case group), and the summary labels the kernels with the workload's case names.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("VIME_RL_KERNEL_CHECK_IDS", "0")  # no host sync in the ids check (as the benchmarks)

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "suites" / "op"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the bench modules (shapes, LossConfig) and rlk_bench
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last: a `kernels` earlier on PYTHONPATH (e.g. a HEAD export) wins

# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    group: str
    # build(device) -> (prepare, profiled): prepare() runs unprofiled and returns the argument of
    # profiled(arg), the launches ncu sees
    build: Callable[[str], tuple[Callable[[], object], Callable[[object], object]]]


def _shapes(small: bool) -> dict[str, object]:
    import bench_grpo_loss
    import bench_linear_logp
    import bench_logp
    import bench_ratio_kl

    if small:
        return {"logits": (64, 1031), "seq": 16, "ratio_kl": 4096, "linear": (32, 64, 1000),
                "config": bench_grpo_loss.CONFIG}
    assert bench_logp.SHAPES[0] == bench_grpo_loss.SHAPES[0] == (8192, 151936)
    return {"logits": bench_logp.SHAPES[0], "seq": bench_grpo_loss.SEQ, "ratio_kl": bench_ratio_kl.NUM_TOKENS,
            "linear": (bench_linear_logp.T, bench_linear_logp.H, bench_linear_logp.V),
            "config": bench_grpo_loss.CONFIG}


def _logits_ids(shape, dtype, device):
    """bench_logp._inputs / bench_grpo_loss._inputs on any device (same generator calls)."""
    import torch

    num_tokens, vocab = shape
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_tokens, vocab, device=device, dtype=dtype, generator=gen)
    ids = torch.randint(0, vocab, (num_tokens,), device=device, generator=gen)
    return logits, ids, gen


def make_cases(small: bool) -> list[Case]:
    import torch

    from kernels.ops.grpo_loss import grpo_loss
    from kernels.ops.linear_logp import linear_logp
    from kernels.ops.logp import logp
    from kernels.ops.ratio_kl import ratio_kl

    sh = _shapes(small)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    cases: list[Case] = []

    for dn, dt in dtypes.items():
        def logp_fwd(device, dt=dt):
            logits, ids, _ = _logits_ids(sh["logits"], dt, device)

            def run(_):
                with torch.no_grad():
                    return logp(logits, ids)
            return (lambda: None), run

        def logp_bwd(device, dt=dt):
            logits, ids, _ = _logits_ids(sh["logits"], dt, device)
            logits.requires_grad_()
            grad = torch.ones(logits.shape[0], device=device)
            return (lambda: logp(logits, ids)), (lambda out: torch.autograd.grad(out, logits, grad))

        def grpo_inputs(device, dt):
            """bench_grpo_loss._inputs on any device."""
            logits, ids, gen = _logits_ids(sh["logits"], dt, device)
            num_tokens = logits.shape[0]
            base = -torch.rand(num_tokens, device=device, generator=gen) * 5
            kw = {
                "old_logp": base + 0.1 * torch.randn(num_tokens, device=device, generator=gen),
                "ref_logp": base + 0.1 * torch.randn(num_tokens, device=device, generator=gen),
                "advantages": torch.randn(num_tokens, device=device, generator=gen),
                "loss_mask": torch.rand(num_tokens, device=device, generator=gen) > 0.1,
                "lengths": torch.full((num_tokens // sh["seq"],), sh["seq"], device=device),
            }
            return logits.requires_grad_(), ids, kw

        def grpo_fwd(device, dt=dt):
            logits, ids, kw = grpo_inputs(device, dt)
            return (lambda: None), (lambda _: grpo_loss(logits, ids, config=sh["config"], **kw))

        def grpo_bwd(device, dt=dt):
            logits, ids, kw = grpo_inputs(device, dt)
            return ((lambda: grpo_loss(logits, ids, config=sh["config"], **kw)[0]),
                    (lambda loss: torch.autograd.grad(loss, logits)))

        cases += [Case(f"logp_fwd_{dn}", "mem", logp_fwd), Case(f"logp_bwd_{dn}", "mem", logp_bwd),
                  Case(f"grpo_fwd_{dn}", "mem", grpo_fwd), Case(f"grpo_bwd_{dn}", "mem", grpo_bwd)]

    for kl_type in ("low_var_kl", "k2"):
        def ratio_inputs(device):
            """bench_ratio_kl.test_bench_ratio_kl's inputs."""
            n = sh["ratio_kl"]
            gen = torch.Generator(device=device).manual_seed(0)
            lp = -torch.rand(n, device=device, generator=gen) * 5
            old = lp + 0.1 * torch.randn(n, device=device, generator=gen)
            ref = lp + 0.1 * torch.randn(n, device=device, generator=gen)
            mask = (torch.rand(n, device=device, generator=gen) > 0.1).float()
            return lp, old, ref, mask

        def ratio_fwd(device, kl_type=kl_type):
            lp, old, ref, mask = ratio_inputs(device)

            def run(_):
                with torch.no_grad():
                    return ratio_kl(lp, old, ref, mask, kl_type=kl_type)
            return (lambda: None), run

        def ratio_bwd(device, kl_type=kl_type):
            lp, old, ref, mask = ratio_inputs(device)
            leaf = lp.clone().requires_grad_()
            g = torch.ones_like(lp)
            return ((lambda: ratio_kl(leaf, old, ref, mask, kl_type=kl_type)),
                    (lambda out: torch.autograd.grad(list(out), leaf, [g, g])))

        cases += [Case(f"ratio_kl_fwd_{kl_type}", "mem", ratio_fwd), Case(f"ratio_kl_bwd_{kl_type}", "mem", ratio_bwd)]

    def linear_inputs(device):
        """bench_linear_logp.issue_shape on any device."""
        T, H, V = sh["linear"]
        gen = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(T, H, device=device, generator=gen, dtype=torch.bfloat16)
        weight = (torch.randn(V, H, device=device, generator=gen) * (2.0 / H**0.5)).to(torch.bfloat16)
        ids = torch.randint(0, V, (T,), device=device, generator=gen)
        ids[:2] = torch.tensor([0, V - 1], device=device)
        upstream = torch.randn(T, device=device, generator=gen)
        return hidden.requires_grad_(), weight.requires_grad_(), ids, upstream

    def linear_fwd(device):
        hidden, weight, ids, _ = linear_inputs(device)

        def run(_):
            with torch.no_grad():
                return linear_logp(hidden, weight, ids)
        return (lambda: None), run

    def linear_bwd(device):
        hidden, weight, ids, upstream = linear_inputs(device)
        return ((lambda: linear_logp(hidden, weight, ids)),
                (lambda out: torch.autograd.grad(out, (hidden, weight), upstream)))

    cases += [Case("linear_logp_fwd_bf16", "linear_fwd", linear_fwd),
              Case("linear_logp_bwd_bf16", "linear_bwd", linear_bwd)]
    return cases


def run_workload(small: bool, pattern: str, device: str) -> None:
    import torch

    cuda = device == "cuda"
    profiler = torch.cuda.cudart() if cuda else None
    print(f"[ncu_profile] {_which()}", flush=True)
    chosen = [c for c in make_cases(small) if re.search(pattern, c.name)]
    if not chosen:
        raise SystemExit(f"no case matches {pattern!r}")
    for case in chosen:
        t0 = time.perf_counter()
        prepare, profiled = case.build(device)
        profiled(prepare())  # warm-up: compiles, allocator settles
        arg = prepare()
        if cuda:
            torch.cuda.synchronize()
            profiler.cudaProfilerStart()
        # backward on this thread (not autograd's device thread), so the NVTX range covers its kernels
        with torch.autograd.set_multithreading_enabled(False), torch.cuda.nvtx.range(case.name) if cuda else _null():
            result = profiled(arg)
        if cuda:
            torch.cuda.synchronize()
            profiler.cudaProfilerStop()
        _check_finite(case.name, result)
        del prepare, profiled, arg, result
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        print(f"[ncu_profile] {case.name}: done in {time.perf_counter() - t0:.1f} s", flush=True)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _check_finite(name, result) -> None:
    import torch

    items = result if isinstance(result, (tuple, list)) else [result]
    for x in items:
        if isinstance(x, dict):
            _check_finite(name, list(x.values()))
        elif isinstance(x, torch.Tensor) and x.is_floating_point() and not torch.isfinite(x).all():
            raise SystemExit(f"{name}: non-finite output")


# ---------------------------------------------------------------------------------------------
# ncu driver
# ---------------------------------------------------------------------------------------------

SECTIONS = ["SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "ComputeWorkloadAnalysis",
            "WarpStateStats"]
# (base name as --query-metrics lists it, full metric); added only where the base name exists
EXTRA_METRICS = [
    ("gpu__time_duration", "gpu__time_duration.sum"),
    ("dram__bytes_read", "dram__bytes_read.sum"),
    ("dram__bytes_write", "dram__bytes_write.sum"),
    ("dram__throughput", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("lts__t_sector_hit_rate", "lts__t_sector_hit_rate.pct"),
    ("sm__warps_active", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("sm__throughput", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("launch__registers_per_thread", "launch__registers_per_thread"),
    ("launch__shared_mem_per_block_static", "launch__shared_mem_per_block_static"),
    ("launch__shared_mem_per_block_dynamic", "launch__shared_mem_per_block_dynamic"),
    ("sm__pipe_tensor_cycles_active", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("sm__pipe_tensor_op_gmma_cycles_active", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("sm__pipe_tensor_op_hmma_cycles_active", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("sm__inst_executed_pipe_tensor_op_gmma", "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active"),
    ("sm__inst_executed_pipe_xu", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("sm__pipe_fma_cycles_active", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("sm__inst_executed_pipe_lsu", "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active"),
]
# group -> (case regex, --launch-count or None, timeout s)
GROUPS = {
    "mem": (r"^(logp|grpo|ratio_kl)_", None, 230),
    "linear_fwd": (r"^linear_logp_fwd", None, 90),
    # 2 (grad_rows) + 3 per vocab chunk (dlogits tile kernel, dH mm, dW mm): chunk 0 (mm) and 1 (addmm)
    "linear_bwd": (r"^linear_logp_bwd", 12, 120),
}


def _find_ncu() -> str:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("usr/local/cuda*/bin/ncu", "opt/nvidia/nsight-compute/*/ncu"):
        hits = sorted(Path("/").glob(pattern))
        if hits:
            return str(hits[-1])
    raise SystemExit("ncu not found")


def _sh(cmd: list[str], timeout: float | None = None, stdout=None) -> subprocess.CompletedProcess:
    """Runs cmd in its own process group; on timeout kills the group (ncu and the profiled python child)
    and raises subprocess.TimeoutExpired."""
    print("[ncu_profile] $ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=stdout if stdout is not None else subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out or "", err or "")


def run_ncu(out: Path, groups: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/ncu_profile")
    work.mkdir(exist_ok=True)
    ncu = _find_ncu()
    # the script itself (not `python -c`, whose sys.path starts with the cwd) says which `kernels` it imports
    meta = [f"ncu: {ncu}", _sh([sys.executable, str(Path(__file__).resolve()), "--which"]).stdout.strip()]
    version = _sh([ncu, "--version"])
    meta.append(version.stdout.strip())
    listed = _sh([ncu, "--list-sections"])
    sections = [s for s in SECTIONS if re.search(rf"\b{s}\b", listed.stdout)] or SECTIONS
    meta.append(f"sections: {' '.join(sections)} (missing: {sorted(set(SECTIONS) - set(sections))})")
    query = _sh([ncu, "--query-metrics"], timeout=120)
    names = {ln.split()[0] for ln in map(str.strip, query.stdout.splitlines()) if re.match(r"^[a-z0-9]+__\w+", ln)}
    tensor = sorted(n for n in names if n.startswith("sm__pipe_tensor"))
    meta.append(f"--query-metrics: {len(names)} base names (rc {query.returncode}); tensor ones: {' '.join(tensor)}")
    metrics = [full for base, full in EXTRA_METRICS if base in names]
    meta.append(f"extra metrics: {','.join(metrics)}")
    print("\n".join(meta), flush=True)
    reps = []
    for group in groups:
        pattern, count, timeout = GROUPS[group]
        rep = work / f"{group}.ncu-rep"
        base = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--nvtx", "--target-processes", "all"]
        for s in sections:
            base += ["--section", s]
        if count:
            base += ["--launch-count", str(count)]
        app = ["--export", str(rep), "--force-overwrite", sys.executable, str(Path(__file__).resolve()),
               "--cases", pattern]
        t0 = time.perf_counter()
        cmd = base + (["--metrics", ",".join(metrics)] if metrics else []) + app
        try:
            res = _sh(cmd, timeout=timeout)
            if res.returncode != 0 and metrics and "metric" in (res.stdout + res.stderr).lower():
                meta.append(f"{group}: retry without --metrics: {res.stderr[-500:]}")
                cmd = base + app
                res = _sh(cmd, timeout=timeout)
        except subprocess.TimeoutExpired:
            meta.append(f"{group}: ncu timed out after {timeout} s")
            print(meta[-1], flush=True)
            continue
        line = f"{group}: ncu rc {res.returncode} in {time.perf_counter() - t0:.0f} s; command: {' '.join(cmd)}"
        meta.append(line)
        print(line + "\n" + res.stdout[-3000:] + res.stderr[-3000:], flush=True)
        if not rep.exists():
            continue
        reps.append(rep)
        for page in ("raw", "details"):
            target = out / f"{group}_{page}.csv"
            for units in (["--print-units", "base"], []):
                with target.open("w") as f:
                    res = _sh([ncu, "--import", str(rep), "--csv", "--page", page, *units], stdout=f, timeout=120)
                if res.returncode == 0:
                    break
                meta.append(f"{group} {page}: import rc {res.returncode}: {res.stderr[-300:]}")
        summarize(out, header="\n".join(f"    {m}" for m in meta), echo=False)  # partial results survive a timeout
    if reps:
        with tarfile.open(out / "ncu-reps.tar.gz", "w:gz") as tar:
            for rep in reps:
                tar.add(rep, arcname=rep.name)
    summarize(out, header="\n".join(f"    {m}" for m in meta))


# ---------------------------------------------------------------------------------------------
# summary of the raw pages
# ---------------------------------------------------------------------------------------------

_SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,  # -> us
          "s": 1e6, "second": 1e6,
          "byte": 1e-6, "kbyte": 1e-3, "mbyte": 1.0, "gbyte": 1e3,  # -> MB
          "byte/block": 1e-3, "kbyte/block": 1.0, "mbyte/block": 1e3,  # -> KB
          "hz": 1e-6, "khz": 1e-3, "mhz": 1.0, "ghz": 1e3}  # -> MHz
SMALL_US = 20.0  # kernels shorter than this are summed per case, not listed one by one
TENSOR = ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
          "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def _num(value: str, unit: str = "") -> float | None:
    try:
        x = float(str(value).split(" (")[0].replace(",", ""))
    except ValueError:
        return None
    return x * _SCALE.get(unit.strip().lower(), 1.0)


def read_raw(path: Path) -> list[dict[str, object]]:
    """Rows of an ncu ``--page raw --csv`` export: header, units, one row per kernel."""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith("==")]
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        return []
    header, units, data = rows[0], rows[1], rows[2:]
    nvtx = next((i for i, h in enumerate(header) if h.startswith("thread Domain:Push/Pop_Range")), None)
    out = []
    for row in data:
        rec: dict[str, object] = {"_nvtx": row[nvtx] if nvtx is not None and nvtx < len(row) else ""}
        for i, h in enumerate(header):
            if i < len(row):
                rec[h] = row[i]
                rec[h + "#unit"] = units[i] if i < len(units) else ""
        out.append(rec)
    return out


def _metric(rec, *names) -> float | None:
    for n in names:
        if n in rec and rec[n] != "":
            v = _num(rec[n], rec.get(n + "#unit", ""))
            if v is not None:
                return v
    return None


def _label(records: list[dict[str, object]], case_names: list[str]) -> list[str]:
    """Case of each kernel (in launch order): its NVTX range; kernels without one (launched by
    autograd's device thread, which the range of the calling thread does not cover) go to the one
    case between their labelled neighbours that has no labelled kernel, else to the previous case."""
    def named(nvtx: str) -> str | None:
        hits = [c for c in case_names if c in nvtx]
        return max(hits, key=len) if hits else None

    labels = [named(str(r["_nvtx"])) for r in records]
    seen = set(filter(None, labels))
    order = {c: i for i, c in enumerate(case_names)}
    for i, lab in enumerate(labels):
        if lab is not None:
            continue
        prev = next((labels[j] for j in range(i - 1, -1, -1) if labels[j] in order), None)
        nxt = next((labels[j] for j in range(i + 1, len(labels)) if labels[j] in order and labels[j] in seen), None)
        lo = order[prev] + 1 if prev else 0
        hi = order[nxt] if nxt else len(case_names)
        gap = [c for c in case_names[lo:hi] if c not in seen]
        labels[i] = gap[0] + "*" if len(gap) == 1 else (prev + "*" if prev else "?")
    return labels


def summarize(out: Path, header: str = "", echo: bool = True) -> str:
    case_names = _case_names()
    rows, small = [], {}
    for raw in sorted(out.glob("*_raw.csv")):
        records = read_raw(raw)
        group = GROUPS.get(raw.name[: -len("_raw.csv")])
        names = [c for c in case_names if re.search(group[0], c)] if group else case_names
        for rec, case in zip(records, _label(records, names), strict=True):
            dur = _metric(rec, "gpu__time_duration.sum")
            if dur is not None and dur < SMALL_US:
                n, total = small.get(case.rstrip("*"), (0, 0.0))
                small[case.rstrip("*")] = (n + 1, total + dur)
                continue
            rd = _metric(rec, "dram__bytes_read.sum")
            wr = _metric(rec, "dram__bytes_write.sum")
            smem = sum(v for v in (_metric(rec, "launch__shared_mem_per_block_static"),
                                   _metric(rec, "launch__shared_mem_per_block_dynamic")) if v is not None)
            stalls = sorted(((_num(rec[k]) or 0.0, m.group(1)) for k in rec if (m := STALL.match(k))), reverse=True)
            top = ", ".join(f"{name} {v:.1f}" for v, name in stalls[:2] if v > 0)
            rows.append([
                case, str(rec.get("Kernel Name", "?"))[:40], str(rec.get("Grid Size", "")).replace(" ", ""),
                str(rec.get("Block Size", "")).replace(" ", ""), dur,
                _metric(rec, "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                rd, wr, (rd + wr) / dur if dur and rd is not None and wr is not None else None,  # MB/us = TB/s
                _metric(rec, "lts__t_sector_hit_rate.pct"),
                _metric(rec, "sm__warps_active.avg.pct_of_peak_sustained_active"),
                _metric(rec, "sm__maximum_warps_per_active_cycle_pct"),
                _metric(rec, "launch__registers_per_thread"), smem,
                _metric(rec, "sm__throughput.avg.pct_of_peak_sustained_elapsed"), _metric(rec, *TENSOR),
                _metric(rec, "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
                _metric(rec, "gpc__cycles_elapsed.avg.per_second"), top,
            ])
    cols = ["case", "kernel", "grid", "block", "us", "DRAM % peak", "DRAM rd MB", "DRAM wr MB", "TB/s",
            "L2 hit %", "ach. occ %", "theo. occ %", "regs", "smem KB", "SM %", "tensor %", "XU %", "SM MHz",
            "top stalls (warps per issue)"]

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, (int, float)):
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
        return str(v).replace("|", "/")

    text = ["# ncu summary (tools/ncu_profile.py)", "", header, "",
            "Cases marked * were labelled by launch order (kernels launched by autograd's device thread",
            f"carry no NVTX range). Kernels under {SMALL_US:.0f} us are summed per case below the table.", "",
            "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    text += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    text += ["", "| case | kernels < %.0f us | their total us |" % SMALL_US, "|---|---|---|"]
    text += [f"| {c} | {n} | {t:.1f} |" for c, (n, t) in small.items()]
    body = "\n".join(text) + "\n"
    (out / "summary.md").write_text(body)
    if echo:
        print(body, flush=True)
    return body


def _case_names() -> list[str]:
    try:
        return [c.name for c in make_cases(small=True)]
    except Exception:  # noqa: BLE001 - summary works without the kernels importable
        return []


def _which() -> str:
    import torch
    import triton

    import kernels

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, {gpu}; "
            f"kernels from {Path(kernels.__file__).parent}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=".", help="regex over case names (workload mode)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--list", action="store_true", help="print the case names and groups")
    ap.add_argument("--which", action="store_true", help="print versions, the GPU and where `kernels` is imported from")
    ap.add_argument("--ncu", metavar="OUT_DIR", help="run ncu on this script per group, write CSVs + summary.md")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"with --ncu: comma list of {list(GROUPS)}")
    ap.add_argument("--summarize", metavar="OUT_DIR", help="summary.md from the *_raw.csv files in OUT_DIR")
    args = ap.parse_args()
    if args.which:
        print(_which())
    elif args.list:
        for c in make_cases(args.small):
            print(c.group, c.name)
    elif args.ncu:
        run_ncu(Path(args.ncu), [g for g in args.groups.split(",") if g])
    elif args.summarize:
        summarize(Path(args.summarize))
    else:
        import torch

        run_workload(args.small, args.cases, "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
