"""Launch configurations of logp's forward kernel, timed on this GPU (a script, not a test).

    python tools/probes/probe_logp_forward_config.py --out DIR [--dtypes bf16,fp32] [--rounds N]

For each dtype and shape ([4096, 32000] and [8192, 151936]), every (BLOCK_V, num_warps,
num_stages) of a grid is launched on ``_logp_fwd_kernel`` directly (the statistics written, as a
differentiable call writes them), 20 launches between CUDA events per timing, in interleaved
rounds (every configuration once per round, so drifting clocks hit all alike), the median over
rounds. Beside them, a read floor: a kernel that only sums each row (the same bytes read, no exp,
no log), at its best (BLOCK_V, num_warps) of the same grid: how close any row-wise read gets to the
copy bandwidth at this size. Every figure is also given as a fraction of the read limit (the
logits' bytes at the copy bandwidth measured in the same process, as the benchmarks state it).
The configuration ``vocab_block(read_only=True)`` picks is marked.

Then the benchmark's own conditions (pytest_rlk.timing.bench: one call per timing, L2 flushed
before each by writing a 256 MiB buffer, whose dirty lines the timed kernel then evicts to HBM):
the public ``kernels.logp`` call (no gradient, as bench_logp.py times it), the default
configuration's kernel, the fastest logp configuration and the fastest floor, each with that flush,
with a flush that reads the buffer instead (clean lines: nothing to write back), and without a
flush. Results: DIR/probe.json and DIR/probe.md. Measured results and commands: docs/performance-notes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "suites" / "op"  # rlk_bench and the bench modules
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

os.environ.setdefault("VIME_RL_KERNEL", "1")  # the public call as a user of the kernels makes it

import torch
import triton
import triton.language as tl
from rlk_bench import hbm_bytes_per_s

from kernels import device_errors
from kernels.ops import logp as logp_op
from pytest_rlk import timing

SHAPES = ((4096, 32000), (8192, 151936))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BLOCKS = (2048, 4096, 8192, 16384, 32768)
WARPS = (4, 8, 16)
STAGES = (None, 2, 4)  # None: Triton's default


@triton.jit
def _row_sum_kernel(logits_ptr, out_ptr, stride_row, vocab, BLOCK_V: tl.constexpr):
    """The read floor: each row's sum (every element read once, nothing else)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        acc += tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, 0))


def configs(dtype: torch.dtype) -> list[tuple[int, int, int | None]]:
    cap = 16384 if dtype == torch.float32 else 32768  # registers: a tile of 32768 fp32 spills
    return [(b, w, s) for b in BLOCKS if b <= cap for w in WARPS for s in STAGES if b // (32 * w) >= 4]


def _events_ms(launch, launches: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / launches


def _fwd_launcher(logits, ids, out, word, block, warps, stages):
    num_tokens, vocab = logits.shape
    extra = {} if stages is None else {"num_stages": stages}

    def launch():
        logp_op._logp_fwd_kernel[(num_tokens,)](
            logits, ids, out[0], out[1], out[2], word.tensor, logits.stride(0), vocab, 0, vocab, -100, 1.0, 0,
            BLOCK_V=block, SCALE=False, PARTIAL=False, STATS=True, num_warps=warps, **extra)
    return launch


def _floor_launcher(logits, out, block, warps, stages):
    num_tokens, vocab = logits.shape
    extra = {} if stages is None else {"num_stages": stages}

    def launch():
        _row_sum_kernel[(num_tokens,)](logits, out[0], logits.stride(0), vocab, BLOCK_V=block, num_warps=warps,
                                       **extra)
    return launch


def probe(dtype_names: list[str], rounds: int) -> dict:
    bandwidth = hbm_bytes_per_s()
    word = device_errors.word_for(torch.device("cuda"))
    results: dict = {"copy_bandwidth_TBps": bandwidth / 1e12, "cases": []}
    for name in dtype_names:
        dtype = DTYPES[name]
        for num_tokens, vocab in SHAPES:
            gen = torch.Generator(device="cuda").manual_seed(0)
            logits = torch.randn(num_tokens, vocab, device="cuda", dtype=dtype, generator=gen)
            ids = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=gen)
            out = torch.empty((3, num_tokens), device="cuda", dtype=torch.float32)
            limit_ms = logits.numel() * logits.element_size() / bandwidth * 1e3
            default = logp_op.vocab_block(vocab, dtype, read_only=True)
            launchers = {}
            for block, warps, stages in configs(dtype):
                kinds = [("logp", _fwd_launcher(logits, ids, out, word, block, warps, stages))]
                if stages is None:  # the floor at Triton's default stages only (build time on the device)
                    kinds.append(("floor", _floor_launcher(logits, out, block, warps, stages)))
                for kind, launch in kinds:
                    try:
                        launch()  # compile
                        torch.cuda.synchronize()
                    except Exception as exc:  # noqa: BLE001 - a configuration Triton cannot build is recorded, not fatal
                        results["cases"].append({"dtype": name, "shape": [num_tokens, vocab], "kind": kind,
                                                 "block": block, "warps": warps, "stages": stages,
                                                 "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]})
                        continue
                    launchers[(kind, block, warps, stages)] = launch
            times: dict = {key: [] for key in launchers}
            for _ in range(rounds):
                for key, launch in launchers.items():
                    launch()
                    times[key].append(_events_ms(launch))
            for (kind, block, warps, stages), samples in times.items():
                ms = statistics.median(samples)
                results["cases"].append({
                    "dtype": name, "shape": [num_tokens, vocab], "kind": kind, "block": block, "warps": warps,
                    "stages": stages, "ms": ms, "of_limit": limit_ms / ms,
                    "default": kind == "logp" and (block, warps) == default and stages is None})
            results["bench_conditions"] = results.get("bench_conditions", []) + _bench_conditions(
                name, logits, ids, results["cases"], launchers, limit_ms)
            del logits
            torch.cuda.empty_cache()
    return results


def _bench_conditions(name, logits, ids, cases, launchers, limit_ms) -> list[dict]:
    import kernels

    shape = list(logits.shape)
    timed = [c for c in cases if "ms" in c and c["dtype"] == name and c["shape"] == shape]
    chosen = {"logp default": next(c for c in timed if c.get("default")),
              "logp fastest": min((c for c in timed if c["kind"] == "logp"), key=lambda c: c["ms"]),
              "floor fastest": min((c for c in timed if c["kind"] == "floor"), key=lambda c: c["ms"])}
    calls = {label: launchers[(c["kind"], c["block"], c["warps"], c["stages"])] for label, c in chosen.items()}
    calls["kernels.logp (public call)"] = lambda: kernels.logp(logits, ids)
    buffer = torch.empty(timing._L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    rows = []
    with torch.no_grad():
        for label, call in calls.items():
            for flush in ("write (the benchmark)", "read", "none"):
                if flush == "read":
                    def fn(call=call):
                        buffer.max()  # evicts the inputs, leaves clean lines
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        call()
                        end.record()
                        return start, end
                    samples = []
                    for _ in range(50):
                        start, end = fn()
                        end.synchronize()
                        samples.append(start.elapsed_time(end))
                    ms = statistics.median(samples[10:])
                else:
                    ms = timing.bench(call, flush_l2=flush != "none", device="cuda").median_ms
                rows.append({"dtype": name, "shape": shape, "what": label, "flush": flush, "ms": ms,
                             "of_limit": limit_ms / ms})
    return rows


def table(results: dict) -> str:
    lines = [f"copy bandwidth {results['copy_bandwidth_TBps']:.2f} TB/s", "",
             "| dtype | shape | kernel | BLOCK_V | warps | stages | ms | of limit | |", "|---|---|---|---|---|---|---|---|---|"]
    cases = [c for c in results["cases"] if "ms" in c]
    for key in sorted({(c["dtype"], tuple(c["shape"]), c["kind"]) for c in cases}):
        group = sorted((c for c in cases if (c["dtype"], tuple(c["shape"]), c["kind"]) == key), key=lambda c: c["ms"])
        shown = group[:5] + [c for c in group[5:] if c.get("default")]
        for c in shown:
            mark = "default" if c.get("default") else ""
            lines.append(f"| {key[0]} | {key[1][0]}x{key[1][1]} | {key[2]} | {c['block']} | {c['warps']} | "
                         f"{c['stages'] or '-'} | {c['ms']:.4f} | {100 * c['of_limit']:.1f}% | {mark} |")
    lines += ["", "Under the benchmark's conditions (one call per timing):", "",
              "| dtype | shape | what | L2 flush | ms | of limit |", "|---|---|---|---|---|---|"]
    for row in results.get("bench_conditions", []):
        lines.append(f"| {row['dtype']} | {row['shape'][0]}x{row['shape'][1]} | {row['what']} | {row['flush']} | "
                     f"{row['ms']:.4f} | {100 * row['of_limit']:.1f}% |")
    errors = [c for c in results["cases"] if "error" in c]
    if errors:
        lines += ["", f"{len(errors)} configurations did not build; first: {errors[0]['error']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_logp_forward_config: needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    results = probe(args.dtypes.split(","), args.rounds)
    (args.out / "probe.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (args.out / "probe.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
