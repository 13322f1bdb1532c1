"""One arm's capacity on one model: the largest micro-batch that fits (capacity_search), then
tokens/s, peak memory and the step's breakdown at a common set of sizes and at the arm's largest.

A step: ``forward`` (the arm's model part), ``loss`` (its log-prob and loss), ``backward``,
``optimizer`` (grad-norm clip at 1.0 and AdamW), each timed by ``train_step.synced_timer`` (the
device synchronized at both ends). Peak memory: on CUDA the allocator's peak over the step, in
all (``peak_bytes``) and above what was allocated when the probe started (``peak_extra_bytes``:
the model, its optimizer states), and the allocator's reserved peak above its start
(``peak_reserved_extra_bytes``, what the search's line aims at the free memory with); on CPU the
``MemoryCap`` stand-in's peak (``peak_extra_bytes``).

A probe of the search runs one step; a size that is measured runs one more step first (its
warm-up at that shape: Triton's autotuning, the allocator's first blocks) and reports the median
of ``steps`` timed steps. The search's probes give the memory at every size tried; their step
times hold first-call costs and are not reported as tokens/s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from suites.module import capacity_arms, capacity_models, train_step
from suites.module.capacity_search import (
    DEFAULT_REL_TOL,
    MemoryCap,
    Probe,
    SearchResult,
    largest_fitting,
    release_memory,
    run_probe,
)

STAGES = ("forward", "loss", "backward", "optimizer")


@dataclasses.dataclass(frozen=True)
class CapacityCase:
    """One model, one recompute setting and the search's range: what every arm runs."""

    spec: capacity_models.ModelSpec
    recompute: bool
    seq_len: int  # the tokens of one packed sample (shorter when a micro-batch holds fewer)
    start: int  # the search's first size
    limit: int  # the search's largest size
    common_sizes: tuple[int, ...]  # measured in every arm that fits them
    quantum: int  # sizes are multiples of it
    steps: int = 2  # timed steps per measured size (after one warm-up step)
    rel_tol: float = DEFAULT_REL_TOL
    cpu_cap_bytes: int | None = None  # CPU only: the MemoryCap stand-in's cap

    @property
    def label(self) -> str:
        return f"{self.spec.name}-recompute_{'on' if self.recompute else 'off'}"


# The CPU form's cap (the MemoryCap stand-in for the HBM limit): 1.5 MiB, where a tiny Qwen3's
# logits dominate a step's memory (suites/module/test_capacity.py states what each arm fits)
CPU_CAP_BYTES = 3 << 19


def cpu_form_case(cap_bytes: int = CPU_CAP_BYTES) -> CapacityCase:
    """The capacity search's CPU form: the tiny Qwen3, recompute off, packed samples of 32 tokens."""
    return CapacityCase(capacity_models.TINY_SPEC, False, seq_len=32, start=16, limit=4096, common_sizes=(16,),
                        quantum=8, steps=1, cpu_cap_bytes=cap_bytes)


@dataclasses.dataclass
class Measured:
    tokens: int
    tokens_per_s: float
    step_s: float
    stages_ms: dict[str, float]
    peak_extra_bytes: int
    peak_bytes: int | None  # CUDA only


@dataclasses.dataclass
class ArmCapacity:
    arm: str
    label: str
    case: str
    search: SearchResult
    measured: dict[int, Measured]  # by size: the common sizes that fit and the largest
    unmeasured: dict[int, str]  # a size the search found fitting that ran out of memory when measured
    resident: dict[str, int]  # parameters, optimizer states

    def summary(self) -> dict[str, Any]:
        return {"arm": self.arm, "label": self.label, "case": self.case, "largest": self.search.largest,
                "smallest_failing": self.search.smallest_failing, "bounded_by_limit": self.search.bounded_by_limit,
                "rel_tol": self.search.rel_tol, "resident_bytes": self.resident,
                "probes": [dataclasses.asdict(p) for p in self.search.probes],
                "measured": {str(k): dataclasses.asdict(v) for k, v in self.measured.items()},
                "unmeasured": {str(k): v for k, v in self.unmeasured.items()}}


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, arm: capacity_arms.Arm,
             mb: capacity_arms.MicroBatch, device: torch.device) -> dict[str, float]:
    """One optimizer step of ``arm`` on ``mb``; returns each stage's wall time (ms)."""
    walls: dict[str, float] = {}
    timed = train_step.synced_timer(device, walls)
    out = timed("forward", lambda: arm.forward(model, mb))
    loss = timed("loss", lambda: arm.loss(model, mb, out))
    del out  # what the backward needs, the graph holds

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timed("backward", loss.backward)
    del loss
    timed("optimizer", update)
    return walls


def _steps_at(case: CapacityCase, model, optimizer, arm, device, tokens: int, steps: int) -> dict[str, Any]:
    """``1 + steps`` steps at ``tokens`` (the first a probe or a warm-up), their times and the peak."""
    cap = MemoryCap(case.cpu_cap_bytes) if device.type == "cpu" else None
    start_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start_reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    walls = []
    with cap if cap is not None else contextlib.nullcontext():
        try:
            mb = capacity_arms.make_micro_batch(tokens, case.seq_len, case.spec.vocab_size, device)
            for _ in range(1 + steps):
                walls.append(one_step(model, optimizer, arm, mb, device))
        except BaseException:
            optimizer.zero_grad(set_to_none=True)  # a backward cut short leaves gradients behind
            raise
        actual = mb.tokens
        del mb
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device) - start_reserved  # what meets the device's limit
        return {"tokens": actual, "walls": walls, "peak_bytes": peak, "peak_extra_bytes": peak - start_bytes,
                "peak_reserved_extra_bytes": reserved}
    return {"tokens": actual, "walls": walls, "peak_bytes": None, "peak_extra_bytes": cap.peak_bytes}


def _measured(found: dict[str, Any], steps: int) -> Measured:
    timed = found["walls"][1:] if steps else found["walls"]
    step_s = statistics.median(sum(w.values()) for w in timed) / 1e3
    stages = {s: statistics.median(w[s] for w in timed) for s in STAGES}
    return Measured(found["tokens"], found["tokens"] / step_s, step_s, stages, int(found["peak_extra_bytes"]),
                    found["peak_bytes"])


def probe_headroom(case: CapacityCase, device: torch.device) -> int | None:
    """The bytes a probe may take above what it starts from (the search's line aims at it): on CUDA
    the device's free memory once the cache is released; on CPU the MemoryCap stand-in's cap."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return case.cpu_cap_bytes


def _peak_of(probe: Probe) -> int | None:
    """A fitting probe's memory in the terms of ``probe_headroom``: on CUDA what the allocator reserved
    above its start (the blocks, fragmentation included, that meet the device's limit), on CPU the cap's peak."""
    measured = probe.measured
    return measured.get("peak_reserved_extra_bytes", measured.get("peak_extra_bytes"))


def _say_nothing(message: str) -> None:
    return None


def run_arm(case: CapacityCase, arm: capacity_arms.Arm, device: torch.device, *,
            dtype: torch.dtype | None = None, out_dir: Path | None = None,
            progress: Callable[[str], None] = _say_nothing) -> ArmCapacity:
    """The search and the measurements of ``arm`` on a fresh model and optimizer (see the module
    docstring); the arm's kernel switches hold throughout. ``progress`` hears one line per probe
    and per measured size (a probe of a 4B model takes seconds; a search, minutes)."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    with capacity_arms.arm_environment(arm):
        model = capacity_models.build_model(case.spec, device=device, dtype=dtype, recompute=case.recompute)
        optimizer = capacity_models.make_optimizer(model)
        resident = capacity_models.resident_bytes(model, optimizer)
        release_memory(device)

        def probe_once(tokens: int) -> Probe:
            result = run_probe(lambda n: _steps_at(case, model, optimizer, arm, device, n, 0), tokens, device)
            progress(f"{arm.name}: {tokens} tokens " + ("fit" if result.fits else "out of memory"))
            return result

        headroom = probe_headroom(case, device)
        search = largest_fitting(probe_once, start=case.start, limit=case.limit, rel_tol=case.rel_tol,
                                 quantum=case.quantum, headroom_bytes=headroom,
                                 peak_of=None if headroom is None else _peak_of)
        sizes = [n for n in case.common_sizes if search.largest is not None and n <= search.largest]
        if search.largest is not None and search.largest not in sizes:
            sizes.append(search.largest)
        measured, unmeasured = {}, {}
        for tokens in sizes:
            result = run_probe(lambda n: _steps_at(case, model, optimizer, arm, device, n, case.steps), tokens, device)
            progress(f"{arm.name}: measured at {tokens} tokens" + ("" if result.fits else " (out of memory)"))
            if result.fits:  # a size that fit in the search can run out at a second try (fragmentation)
                measured[tokens] = _measured(result.measured, case.steps)
            else:
                unmeasured[tokens] = result.out_of_memory
        for probe in search.probes:  # the memory each probe reached (its step time is a first call)
            probe.measured.pop("walls", None)
        del model, optimizer, probe_once
    release_memory(device)  # the next arm starts from an empty device
    found = ArmCapacity(arm.name, arm.label, case.label, search, measured, unmeasured, resident)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"capacity-{case.label}-{arm.name}.json").write_text(json.dumps(found.summary(), indent=1))
    return found


# The run report draws a line per arm through the metrics tagged ``curve`` (pytest_rlk.report_data:
# ``curve`` the chart, ``curve_x`` / ``curve_y`` its axes, ``curve_at`` the point's x, ``arm`` the line).
CURVE_X = "tokens per micro-batch"


def memory_unit(device: torch.device) -> tuple[str, float, str]:
    """(unit, bytes per unit, the y axis) of the memory a probe records: on CUDA the allocator's
    whole peak in GiB; on CPU the MemoryCap stand-in's peak above the model and optimizer, in MiB."""
    if device.type == "cuda":
        return "GiB", 2.0**30, "peak memory [GiB]"
    return "MiB", 2.0**20, "peak memory [MiB] above resident (CPU cap stand-in)"


def record(rlk_metrics, found: ArmCapacity, device: torch.device, *, gate: bool) -> None:
    """Record ``found``: the largest size and the tokens/s there (gated where ``gate``: our arms on a
    GPU, as the op benchmarks gate our default call only), and, for the report's charts and tables,
    the memory of every size that fit, tokens/s, peak memory and the stage times of every measured size."""
    search = found.search
    tags = {"arm": found.arm, "case": found.case, "arm_label": found.label}
    rlk_metrics.record(f"{found.arm}_largest_tokens", float(search.largest or 0), unit="tokens",
                       direction="higher_is_better", space="count", gate=gate and search.largest is not None,
                       band={"rel": search.rel_tol, "source": "the capacity search's resolution "
                             "(suites/module/capacity_search.py: the largest size is within rel_tol of the limit)"},
                       tags={**tags, "smallest_failing": str(search.smallest_failing),
                             "bounded_by_limit": str(search.bounded_by_limit)})
    curve = {"curve": f"capacity {found.case}", "curve_x": CURVE_X}
    unit, per_unit, memory_y = memory_unit(device)
    for probe in search.fitted():
        peak = probe.measured["peak_bytes"] if device.type == "cuda" else probe.measured["peak_extra_bytes"]
        rlk_metrics.record(f"{found.arm}_probe_T{probe.tokens}_peak_{unit.lower()}", peak / per_unit, unit=unit,
                           direction="lower_is_better", space="memory", gate=False,
                           tags={**tags, **curve, "curve_y": memory_y, "curve_at": str(probe.measured["tokens"])})
    for tokens, m in sorted(found.measured.items()):
        at = "largest" if tokens == search.largest else f"T{tokens}"
        rlk_metrics.record(f"{found.arm}_tokens_per_s_at_{at}", m.tokens_per_s, unit="tokens/s",
                           direction="higher_is_better", space="throughput", gate=gate and at == "largest",
                           tags={**tags, **curve, "curve_y": "tokens/s (median step)", "curve_at": str(m.tokens)})
        peak = m.peak_bytes if m.peak_bytes is not None else m.peak_extra_bytes
        rlk_metrics.record(f"{found.arm}_peak_{unit.lower()}_at_{at}", peak / per_unit, unit=unit,
                           direction="lower_is_better",
                           space="memory", gate=False, tags={**tags, "tokens": str(m.tokens)})
        if at == "largest":
            for stage, ms in m.stages_ms.items():
                rlk_metrics.record(f"{found.arm}_{stage}_ms_at_largest", ms, unit="ms", direction="lower_is_better",
                                   space="time", gate=False, tags={**tags, "module": stage, "tokens": str(m.tokens)})
    for part, nbytes in found.resident.items():  # where the memory every probe starts from goes
        rlk_metrics.record(f"{found.arm}_resident_{part}_{unit.lower()}", nbytes / per_unit, unit=unit,
                           direction="lower_is_better", space="memory", gate=False, tags=tags)
    for tokens, why in found.unmeasured.items():
        rlk_metrics.record(f"{found.arm}_out_of_memory_when_measured_T{tokens}", 1.0, direction="lower_is_better",
                           space="count", gate=False, tags={**tags, "why": why})
