"""Benchmark helpers for suites/op/bench_*.py (GPU only): timing through pytest_rlk.timing, the
HBM limit from bandwidth measured once per process, peers imported only where available, and
recording as metrics (ms lower_is_better; fraction of the HBM limit higher_is_better).

Only our default call's metrics gate against baselines (its wall time: the plain call a user
makes, default settings, no environment variables); peers' and our labelled variants' are recorded
for the tables (gate=False).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch

from kernels.ops.host import HostModule
from pytest_rlk import timing
from pytest_rlk.bands import DEFAULT_BANDS

OURS = "rlk"
HOST_TIME_BAND = DEFAULT_BANDS["host_time"]
LAUNCH_TIME_BAND = DEFAULT_BANDS["launch_time"]
# a host-bound call's wall time: the lowest median of this many rounds, this far apart
HOST_BOUND_ROUNDS, HOST_BOUND_PAUSE_S = 8, 0.25


@functools.cache
def hbm_bytes_per_s() -> float:
    bandwidth = timing.measure_hbm_bandwidth()
    if bandwidth is None:
        raise RuntimeError("benchmarks need a CUDA device")
    return bandwidth


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def graph_replay_ms(fn: Callable[[], object]) -> tuple[float | None, str | None]:
    """(median ms of one CUDA-graph replay of ``fn``, None) or (None, why it could not be captured).

    A replay has no host time in it, so it is the GPU's own time for the call: stable where the
    wall time of a call is not (a case whose GPU work is shorter than its Python, e.g. grpo_loss at
    4096 x 32000, times the host in ``<impl>_ms`` and swings past the +-15% band run to run)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
    except Exception as exc:  # reported in the metric's tags, never silent
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    try:
        return timing.bench(graph.replay, device="cuda").median_ms, None
    finally:
        del graph
        torch.cuda.empty_cache()


def measure(
    rlk_metrics,
    impl: str,
    fn: Callable[[], object],
    bytes_moved: int,
    tags: dict[str, object],
    *,
    memory: bool = True,
    graph: bool = False,
    gate: bool | None = None,
    gate_time: bool | None = None,
    host: HostModule | None = None,
    host_bound: bool = False,
) -> float:
    """Time ``fn``, record its median ms, its fraction of the HBM limit (``bytes_moved`` at the
    measured bandwidth) and its peak extra memory; returns the median ms.

    What gates: our default call (``impl == "rlk"``, or ``gate=True`` for the default call of
    another pass), timed as a user runs it: a plain call, default settings, its wall time (host
    time included). Every other implementation is recorded for the tables, never gated: peers,
    and our labelled variants (``rlk_two_read``, ``rlk_inplace``: other modes of the same op).

    ``gate_time=False`` leaves this measurement's time (and its fraction of the HBM limit) ungated
    where the caller gates a time of its own (a median of interleaved rounds); memory still gates.

    ``graph=True`` also records, beside the wall time, ``<impl>_graph_ms`` (one CUDA-graph replay
    of ``fn``: the GPU's own time, no host time) and ``<impl>_wall_over_graph`` (how much host
    time shows in the plain call: the goal is <= 1.03 at [8192, 151936], <= 1.15 at [4096, 32000]),
    neither gated. If ``fn`` cannot be captured, the tag ``graph_capture`` says why.

    ``host`` (the op's ``HostModule``, ``<op module>._HOST``) tags every metric of this measurement
    with the path that serves the warmed call (``c++``, or ``python`` and why), so that a wall time
    far above its graph replay can be told apart from a fall back to the Python path; where the time
    gates, ``<impl>_on_host_path`` (1: one more call of ``fn`` was served by the C++ host path, 0:
    it was not) gates exactly beside it, so that a call the host path declines is a regression.

    ``host_bound=True`` is for a call whose wall time is its host time (fwd+bwd at launch-bound
    shapes: wall 1.2-5.7x its graph replay on both GPUs; a case whose GPU time is at or below the
    call's host time, as its benchmark states). Its wall time is the lowest of several
    rounds' medians (``timing.bench_lowest_of_rounds``: the host's speed comes in regimes) and
    gates within the host-time band (``pytest_rlk/bands.py``); its fraction of the HBM limit, a
    host-bound figure, is recorded and not gated. Any other call tagged ``size=small`` gates its wall
    time (a few microseconds of device time) in the launch-time band: the time band with a 2 us floor."""
    if gate is None:
        gate = impl == OURS
    gate_time = gate if gate_time is None else gate and gate_time
    fn()  # compile / autotune / warm caches outside the timing
    torch.cuda.synchronize()
    if host_bound:
        result = timing.bench_lowest_of_rounds(fn, rounds=HOST_BOUND_ROUNDS, pause_s=HOST_BOUND_PAUSE_S, device="cuda")
    else:
        result = timing.bench(fn, device="cuda")
    limit_ms = bytes_moved / hbm_bytes_per_s() * 1e3
    fraction = limit_ms / result.median_ms
    all_tags = {**tags, "impl": impl, "gpu": torch.cuda.get_device_name()}
    if host_bound:
        all_tags["wall_timing"] = (f"lowest of {HOST_BOUND_ROUNDS} rounds' medians, {HOST_BOUND_PAUSE_S:g} s apart "
                                   "(host-bound call)")
    if host is not None:
        all_tags["host_path"] = host.path_label()
        if gate_time:
            served_before = host.calls_served()
            fn()
            on_host_path = float(host.calls_served() > served_before)
            rlk_metrics.record(f"{impl}_on_host_path", on_host_path, direction="higher_is_better", space="count",
                               tags=all_tags, gate=True)
    if graph:
        graph_ms, why = graph_replay_ms(fn)
        if graph_ms is None:
            all_tags["graph_capture"] = f"failed ({why})"
        else:
            rlk_metrics.record(f"{impl}_graph_ms", graph_ms, unit="ms", direction="lower_is_better",
                               space="time", tags=all_tags, gate=False)
            rlk_metrics.record(f"{impl}_wall_over_graph", result.median_ms / graph_ms, direction="lower_is_better",
                               space="ratio", tags=all_tags, gate=False)
    band = HOST_TIME_BAND if host_bound else LAUNCH_TIME_BAND if tags.get("size") == "small" else None
    rlk_metrics.record(f"{impl}_ms", result.median_ms, unit="ms", direction="lower_is_better", space="time",
                       tags=all_tags, gate=gate_time, band=band)
    rlk_metrics.record(f"{impl}_fraction_of_hbm_limit", fraction, direction="higher_is_better", space="ratio",
                       tags={**all_tags, "limit_ms": f"{limit_ms:.4f}"}, gate=gate_time and not host_bound)
    if memory:
        extra = timing.peak_extra_memory(fn)
        rlk_metrics.record(f"{impl}_peak_extra_bytes", float(extra), unit="B", direction="lower_is_better",
                           space="memory", tags=all_tags, gate=gate)
    return result.median_ms


def record_limit(rlk_metrics, bytes_moved: int, tags: dict[str, object], name: str = "hbm_limit_ms") -> float:
    limit_ms = bytes_moved / hbm_bytes_per_s() * 1e3
    rlk_metrics.record(name, limit_ms, unit="ms", direction="two_sided", space="time",
                       tags={**tags, "hbm_GBps": f"{hbm_bytes_per_s() / 1e9:.0f}"}, gate=False)
    return limit_ms


def record_host_overhead(rlk_metrics, fn: Callable[[], object], tags: dict[str, object]) -> float:
    """Record ``rlk_host_overhead_us`` of ``fn`` (us per call, not gated: host time depends on the
    host): the lowest of :func:`host_overhead_blocks_us`, every block median in the tags; returns it.

    Why the lowest block: the GPU machines' hosts are shared, and their speed comes in regimes that
    last seconds (on one H100 host: every block median of ``logp`` at 12.6-13.5 us for a few
    seconds, then 19.4-20.3 us, ``torch.empty`` alone 2.5 then 4.6 us). That only ever adds time,
    so, as ``timeit`` advises, the least disturbed block estimates what the call costs; the blocks
    are spread over ~2 s to meet more than one regime."""
    medians = host_overhead_blocks_us(fn)
    rlk_metrics.record("rlk_host_overhead_us", min(medians), unit="us", direction="lower_is_better", space="time",
                       tags={**tags, "block_medians_us": " ".join(f"{m:.1f}" for m in medians)}, gate=False)
    return min(medians)


def host_overhead_blocks_us(fn: Callable[[], object], calls: int = 1000, blocks: int = 8,
                            pause_s: float = 0.25) -> list[float]:
    """The median host time per call of ``fn`` (us) in each of ``blocks`` blocks of ``calls``,
    ``pause_s`` apart: the time the calling thread spends inside ``fn``, the GPU's own time
    excluded. No sync inside a timed span; a sync every 100 calls, outside it, keeps the
    launch queue from filling (a full queue makes a call wait for the GPU); 50 untimed calls
    before each block."""
    import statistics
    import time

    medians = []
    for block in range(blocks):
        if block:
            time.sleep(pause_s)
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        spans = []
        for i in range(calls):
            start = time.perf_counter()
            fn()
            spans.append(time.perf_counter() - start)
            if i % 100 == 99:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        medians.append(statistics.median(spans) * 1e6)
    return medians
