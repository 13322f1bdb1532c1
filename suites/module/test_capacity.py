"""The capacity search (suites/module/capacity_search.py), its CPU form, and the GPU benchmark's
skip on a CPU.

The CPU form: a tiny Qwen3 (capacity_models.TINY_SPEC: vocab 1024 against hidden 32, so the logits
dominate a step's memory, as at Qwen3's 151936 x 1024) under a ``MemoryCap`` (the CPU
stand-in for the HBM limit). vime's path (the fp32 reference of its math: fp32 logits, their
response rows copied, log-softmax, its gradient [R, V]) holds several [T, V] fp32 tensors at once;
``linear_logp`` holds at most its workspace of the logits, kept within its budget, and no [T, V]
gradient. Under a 1.5 MiB cap the search found 48 tokens for vime's path, 64 for our ops on the
logits and 128 for ``linear_logp`` (2.7x; 2026-12-07, torch 2.13 CPU); the test asserts that
``linear_logp`` fits at least ``MIN_GAIN`` times vime's path, that the logits path does not, and that
each search ends between a size that fit and one that did not, within 10%.

The search's narrowing along the line of the peaks (``headroom_bytes``, ``peak_of``): two probes
after doubling where the memory is affine in the tokens, never worse than bisection's result where
the line is wrong.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_rlk.extras import require_extra
from suites.module import capacity_search as search
from suites.module.capacity_search import (
    MemoryCap,
    MemoryCapExceeded,
    Probe,
    ProbeFailed,
    largest_fitting,
    run_probe,
)

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


def _threshold_probe(limit: int, calls: list[int]):
    def probe(tokens: int) -> Probe:
        calls.append(tokens)
        return Probe(tokens, tokens <= limit, out_of_memory=None if tokens <= limit else "out of memory")

    return probe


@pytest.mark.parametrize("limit", [1, 4096, 5000, 40_000, 61_439, 131_073])
def test_the_search_ends_within_ten_percent_of_the_limit(limit):
    calls: list[int] = []
    found = largest_fitting(_threshold_probe(limit, calls), start=1, limit=1 << 20, rel_tol=0.1)
    assert found.largest <= limit < found.smallest_failing
    assert found.smallest_failing - found.largest <= max(1, 0.1 * found.largest)
    assert limit < found.largest * 1.1 + 1
    assert len(calls) == len(set(calls)) == len(found.probes)  # no size tried twice
    assert [p.tokens for p in found.probes[:3]] == calls[:3] and calls[:2] == [1, 2]  # doubling first


def test_the_search_keeps_sizes_on_the_quantum_and_its_tolerance_is_configurable():
    calls: list[int] = []
    found = largest_fitting(_threshold_probe(50_000, calls), start=4096, limit=1 << 20, rel_tol=0.02, quantum=512)
    assert all(n % 512 == 0 for n in calls)
    assert found.largest <= 50_000 < found.smallest_failing
    assert found.smallest_failing - found.largest <= max(512, 0.02 * found.largest)
    coarse = largest_fitting(_threshold_probe(50_000, []), start=4096, limit=1 << 20, rel_tol=0.25, quantum=512)
    assert len(coarse.probes) < len(found.probes)


def _affine_probe(base: int, per_token: int, headroom: int, calls: list[int], actual_headroom: int | None = None):
    """Peak bytes ``base + per_token * tokens``; out of memory past ``actual_headroom`` (default
    ``headroom``: the line tells the truth)."""
    cap = headroom if actual_headroom is None else actual_headroom

    def probe(tokens: int) -> Probe:
        calls.append(tokens)
        peak = base + per_token * tokens
        if peak > cap:
            return Probe(tokens, False, out_of_memory="out of memory")
        return Probe(tokens, True, {"peak_extra_bytes": peak})

    return probe


def _peak(probe: Probe) -> int:
    return probe.measured["peak_extra_bytes"]


@pytest.mark.parametrize("headroom", [3_000_000, 5_000_000, 9_999_999, 64_000_000])
def test_the_line_of_the_peaks_closes_the_bracket_in_two_probes(headroom):
    guided, plain = [], []
    kw = dict(start=512, limit=1 << 22, rel_tol=0.1, quantum=512)
    found = largest_fitting(_affine_probe(400_000, 300, headroom, guided), headroom_bytes=headroom, peak_of=_peak,
                            **kw)
    bisected = largest_fitting(_affine_probe(400_000, 300, headroom, plain), **kw)
    limit = (headroom - 400_000) // 300
    assert found.largest <= limit < found.smallest_failing <= found.largest * 1.1 + 512
    doubling = next(i for i, n in enumerate(guided) if n > limit) + 1  # the probes up to the first out of memory
    assert len(guided) - doubling <= 2, guided
    assert len(guided) <= len(plain), (guided, plain)
    assert bisected.largest <= limit < bisected.smallest_failing


def test_the_line_leaps_past_the_doublings_once_three_sizes_lie_on_it():
    """Affine memory, the limit 2^8 times the start: three sizes, the leap just below the line's
    limit, the top of the window above it. Doubling alone probes eight sizes before running out."""
    calls: list[int] = []
    headroom = 400_000 + 300 * 131_000
    found = largest_fitting(_affine_probe(400_000, 300, headroom, calls), start=512, limit=1 << 22, rel_tol=0.1,
                            quantum=512, headroom_bytes=headroom, peak_of=_peak)
    assert found.largest <= 131_000 < found.smallest_failing <= found.largest * 1.1 + 512
    assert calls[:3] == [512, 1024, 2048] and len(calls) == 5, calls
    assert calls[3] == found.largest and not found.probes[4].fits
    line_says_all = largest_fitting(_affine_probe(400_000, 300, 10**12, []), start=512, limit=1 << 16, rel_tol=0.1,
                                    quantum=512, headroom_bytes=10**12, peak_of=_peak)
    assert [p.tokens for p in line_says_all.probes] == [512, 1024, 2048, 1 << 16] and line_says_all.bounded_by_limit


def test_a_flat_first_slope_is_no_line_to_leap_along():
    """A workspace that stops growing at its cap flattens the peaks of the smallest sizes; a line
    through them would leap orders of magnitude past the limit."""
    capped = [(16, 600_000), (32, 601_000), (64, 880_000)]
    assert not search.steady_line(capped)
    assert search.steady_line([*capped, (128, 1_500_000)])  # 32 -> 64 -> 128 rise alike
    assert not search.steady_line(capped[:2]) and not search.steady_line([(16, 5), (32, 4), (64, 3)])


def test_a_leap_that_runs_out_of_memory_resumes_the_doubling_below_it():
    calls: list[int] = []
    found = largest_fitting(_affine_probe(400_000, 300, 50_000_000, calls, actual_headroom=3_000_000), start=512,
                            limit=1 << 22, rel_tol=0.1, quantum=512, headroom_bytes=50_000_000, peak_of=_peak)
    leap = calls[3]
    assert leap > 8 * 1024 and not found.probe_at(leap).fits  # the line's leap, out of memory
    assert calls[4] == 4096 and all(n < leap for n in calls[4:])  # doubling again, below it
    limit = (3_000_000 - 400_000) // 300
    assert found.largest <= limit < found.smallest_failing <= found.largest * 1.1 + 512
    assert len(calls) == len(set(calls))


@pytest.mark.parametrize("actual", [2_000_000, 4_200_000, 4_900_000, 7_000_000])
def test_a_line_that_is_wrong_hands_the_search_to_bisection_and_the_result_stays_exact(actual):
    """The line says 5 MB fit where the device holds ``actual`` (fragmentation, a workspace that
    does not grow with the tokens): the result is still within 10% of the true limit."""
    calls: list[int] = []
    found = largest_fitting(_affine_probe(400_000, 300, 5_000_000, calls, actual_headroom=actual), start=512,
                            limit=1 << 22, rel_tol=0.1, quantum=512, headroom_bytes=5_000_000, peak_of=_peak)
    limit = (actual - 400_000) // 300
    assert found.largest <= limit < found.smallest_failing
    assert found.smallest_failing - found.largest <= max(512, 0.1 * found.largest)
    assert len(calls) == len(set(calls))


def test_the_line_reads_the_reserved_peak_where_the_allocator_reports_one():
    from suites.module import capacity_run

    cuda = Probe(4096, True, {"peak_extra_bytes": 10, "peak_reserved_extra_bytes": 12})
    assert capacity_run._peak_of(cuda) == 12  # the blocks that meet the device's limit
    assert capacity_run._peak_of(Probe(4096, True, {"peak_extra_bytes": 10})) == 10  # the CPU cap's peak


def test_nothing_fitting_and_the_limit_fitting_are_outcomes():
    none = largest_fitting(_threshold_probe(10, []), start=16, limit=1024)
    assert none.largest is None and none.smallest_failing == 16 and not none.bounded_by_limit
    all_fit = largest_fitting(_threshold_probe(10_000, []), start=16, limit=1000)
    assert all_fit.largest == 1000 and all_fit.smallest_failing is None and all_fit.bounded_by_limit


def test_bad_search_arguments_are_errors_naming_them():
    probe = _threshold_probe(10, [])
    with pytest.raises(ValueError, match="rel_tol"):
        largest_fitting(probe, start=1, limit=8, rel_tol=0.0)
    with pytest.raises(ValueError, match="quantum=8, start=12"):
        largest_fitting(probe, start=12, limit=64, quantum=8)
    with pytest.raises(ValueError, match="headroom_bytes and peak_of come together"):
        largest_fitting(probe, start=1, limit=8, headroom_bytes=1 << 20)
    with pytest.raises(ValueError, match="headroom_bytes must be > 0, got 0"):
        largest_fitting(probe, start=1, limit=8, headroom_bytes=0, peak_of=_peak)


@pytest.mark.parametrize("oom", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.3 GiB"),
                                 MemoryCapExceeded("CPU memory cap: 9.0 MiB live")], ids=["cuda", "cpu_cap"])
def test_out_of_memory_is_an_outcome_of_the_probe(oom):
    def measure(tokens):
        raise oom

    probe = run_probe(measure, 4096, CPU)
    assert not probe.fits and probe.out_of_memory == str(oom)
    assert run_probe(lambda n: {"tokens": n}, 64, CPU) == Probe(64, True, {"tokens": 64})


def test_any_other_error_fails_the_probe_with_its_reason():
    def measure(tokens):
        raise ValueError(f"logits: shape [{tokens}, 7] is not [T, V]")

    with pytest.raises(ProbeFailed, match=r"probe at 4096 tokens failed: ValueError: logits: shape \[4096, 7\]") as info:
        largest_fitting(lambda n: run_probe(measure, n, CPU), start=4096, limit=8192)
    assert isinstance(info.value.__cause__, ValueError)


def test_the_memory_cap_counts_live_storages_and_raises_past_its_cap():
    before = torch.zeros(1 << 20, dtype=torch.uint8)
    with MemoryCap(3 << 20) as cap:
        before.add_(1)  # an in-place op on a storage from before the cap: not counted
        assert cap.live_bytes == 0
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = a.view(torch.int32)[:10]  # a view: no new storage
        del a, b
        c = torch.empty(2 << 20, dtype=torch.uint8)
        assert cap.live_bytes == 2 << 20 and cap.peak_bytes == 2 << 20
        with pytest.raises(MemoryCapExceeded, match="cap 3.0 MiB"):
            torch.empty(2 << 20, dtype=torch.uint8)
        del c
    assert cap.live_bytes == 0
    with pytest.raises(ValueError, match="cap_bytes"):
        MemoryCap(0)


def test_a_micro_batch_packs_equal_samples_of_at_most_seq_len():
    from suites.module.capacity_arms import micro_batch_shape

    assert micro_batch_shape(4096, 4096) == (1, 4096)
    assert micro_batch_shape(9000, 4096) == (3, 3000)
    assert micro_batch_shape(36_864, 4096) == (9, 4096)
    with pytest.raises(ValueError, match="tokens=1"):
        micro_batch_shape(1, 4096)


# linear_logp's gain over vime's path the CPU form asserts: measured 128 / 48 = 2.7x; the logits
# path with our ops (rlk_logp_ratio_kl, 64 tokens: 1.3x) fails it, which the test shows on the same
# run. What it cannot tell apart: an LM head on the response rows only, then our logp (104 tokens,
# 2.2x, measured by hand): at V = 1024 (one chunk of 4096 vocab columns) linear_logp keeps every
# logit in its workspace, as that path does; its budget caps the workspace at V = 151936 only.
MIN_GAIN = 2.0


def gain_problem(arm: str, ours: int, vime: int) -> str | None:
    if ours >= MIN_GAIN * vime:
        return None
    return f"{arm} fits {ours} tokens, {ours / vime:.2f}x vime's path's {vime}: below {MIN_GAIN:g}x"


@pytest.mark.tiny
def test_cpu_capacity_linear_logp_fits_more_tokens_than_vimes_logits_path(rlk_metrics, rlk_progress):
    if torch.cuda.is_available():
        # our Triton kernels take CPU tensors only through Triton's interpreter, which the module
        # tier switches on for CPU-only hosts alone
        pytest.skip("the CPU form of the capacity search (a memory-cap stand-in for the HBM limit); this host "
                    "has a GPU: bench_capacity.py measures the real limit here (-m bench_full)")
    require_extra("transformers")
    from suites.module import capacity_arms, capacity_run

    case = capacity_run.cpu_form_case()
    found, said = {}, []
    for name in (capacity_arms.VIME_PATH, "rlk_linear_logp", "rlk_logp_ratio_kl"):
        arm = capacity_arms.arm_named(name)
        with rlk_progress.step(f"{arm.name}: the largest micro-batch under a {case.cpu_cap_bytes / 2**20:g} MiB cap"):
            found[name] = capacity_run.run_arm(case, arm, CPU, out_dir=rlk_metrics.artifact_dir, progress=said.append)
        capacity_run.record(rlk_metrics, found[name], CPU, gate=False)  # CPU: recorded, not gated
    # one line per probe and per measured size: a GPU search takes minutes
    assert len(said) == sum(len(a.search.probes) + len(a.measured) + len(a.unmeasured) for a in found.values())
    assert "rlk_linear_logp: 16 tokens fit" in said and any(line.endswith("out of memory") for line in said)
    for name, arm in found.items():
        search = arm.search
        assert search.largest is not None and not search.bounded_by_limit, (name, search.probes)
        assert search.smallest_failing - search.largest <= max(case.quantum, 0.1 * search.largest), (name, search)
        assert set(arm.measured) == {16, search.largest} and not arm.unmeasured, (name, arm.unmeasured)
        assert all(m.tokens_per_s > 0 for m in arm.measured.values())
    vime = found[capacity_arms.VIME_PATH].search.largest
    ours, logits_path = found["rlk_linear_logp"].search.largest, found["rlk_logp_ratio_kl"].search.largest
    for name, largest in (("rlk_linear_logp", ours), ("rlk_logp_ratio_kl", logits_path)):
        rlk_metrics.record(f"{name}_gain_over_vime_path", largest / vime, direction="higher_is_better", space="ratio",
                           gate=False, tags={"min_gain": MIN_GAIN})
    assert gain_problem("rlk_linear_logp", ours, vime) is None, gain_problem("rlk_linear_logp", ours, vime)
    # the check, shown failing: the logits path with our ops keeps [T, V] tensors
    assert gain_problem("rlk_logp_ratio_kl", logits_path, vime) is not None, (logits_path, vime)


def test_the_gpu_benchmark_collects_and_skips_on_a_cpu_with_its_reason(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark runs here")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLK_", "VIME_RL_KERNEL"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/module/bench_capacity.py", "--rlk-tier=module", "-m", "bench_full",
         "-k", "qwen3_0p6b and recompute_off", "-rs", "-q", "-p", "no:cacheprovider",
         f"--rlk-artifacts={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "6 skipped" in out and "needs an H100 or H200" in out, out
