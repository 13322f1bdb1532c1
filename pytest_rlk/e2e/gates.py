"""Engine-agnostic A/B gates: two arms' per-step metric series in, verdicts out.

Input per arm: `ArmSeries` (canonical metric name -> list of floats, one per rollout; see
`pytest_rlk.e2e.metrics`). The comparison itself is `pytest_rlk.compare.compare_records` (the
baseline arm is A, the kernel arm is B); this module only decides what is compared in which lane:

- live lane: the metrics marked `live` in `E2E_METRICS`, each reduced over a window that skips
  the warmup rollouts (median for times, max for memory, mean otherwise); speed and memory gate
  only when the spec's `gates` selection says so.
- replay lane (the kernel arm trains on the baseline's recorded rollouts): the metrics marked
  `replay_per_step`, compared rollout by rollout (`loss[3]`), no warmup skipped: the samples are
  identical, so every step must agree.
- both lanes: both arms must have completed the same number of rollouts; the kernel arm's
  fallback count must be 0 over the whole run (warmup included), and an arm that reports no
  fallback count at all fails (nothing proves the kernels ran).
- `entropy_loss` and `entropy` are never compared (`metrics.NEVER_COMPARED` says why).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pytest_rlk.compare import compare_records, compare_value
from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.spec import GateSelection, Lane, ReplayHorizon
from pytest_rlk.schema import Band, GateResult, MetricComparison, MetricRecord, Verdict, Window

ROLLOUTS_COMPLETED = "rollouts_completed"
_ROLLOUTS_BAND = Band(source="rlk: both arms must complete the same number of rollouts")


@dataclass(frozen=True)
class LaneVerdict:
    """The verdict of one lane of one case on one platform."""

    case: str
    platform: str
    lane: Lane
    baseline_label: str
    kernels_label: str
    gate: GateResult
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.gate.failed()

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.verdict.label} ({c.detail})" for c in self.gate.regressions]


@dataclass(frozen=True)
class PairVerdict:
    """The verdict of the A/B pair: passes only if every lane passes."""

    case: str
    platform: str
    lanes: list[LaneVerdict]

    @property
    def passed(self) -> bool:
        return bool(self.lanes) and all(lane.passed for lane in self.lanes)

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"

    def summary(self) -> str:
        lines = [f"A/B {self.case} on {self.platform}: {self.verdict.upper()}"]
        for lane in self.lanes:
            lines.append(
                f"  {lane.lane} lane ({lane.baseline_label} vs {lane.kernels_label}): {lane.verdict}"
            )
            lines.extend(f"    {failure}" for failure in lane.failures())
            lines.extend(f"    note: {note}" for note in lane.notes)
        return "\n".join(lines)


def _check_series(arm: str, series: Mapping[str, list[float]]) -> int:
    """The arm's rollout count (the longest series). Gated series must cover every rollout;
    report-only ones may be shorter (weight-sync time has no value before the first sync)."""
    n = max((len(values) for values in series.values()), default=0)
    short = {name: len(values) for name, values in series.items()
             if len(values) != n and name in m.E2E_METRICS and m.E2E_METRICS[name].gated}
    if short:
        raise ValueError(f"{arm} arm: series lengths differ (one value per rollout expected, {n} rollouts): {short}")
    return n


def _group_enabled(policy: m.MetricPolicy, gates: GateSelection) -> bool:
    if policy.group == "speed":
        return gates.speed
    if policy.group == "memory":
        return gates.memory
    return policy.group == "correctness"


def _record(policy: m.MetricPolicy, name: str, value: float | list[float], window: Window | None,
            band: Band | None = None) -> MetricRecord:
    return MetricRecord(
        name=name, value=value, unit=policy.unit, direction=policy.direction, space=policy.space,
        band=band or policy.band, window=window, allow_nonfinite=True,
    )


def lane_records(series: Mapping[str, list[float]], *, lane: Lane, skip_warmup: int,
                 gates: GateSelection, bands: Mapping[str, Band] | None = None,
                 replay_steps: int | None = None) -> dict[str, MetricRecord]:
    """The records of one arm that are compared in `lane` (with their bands and windows).
    `bands`: the case's overrides, "<lane>.<metric>" -> band (the spec's `bands`);
    `replay_steps`: the replay lane compares steps 0 .. replay_steps-1 (None: every step)."""
    out: dict[str, MetricRecord] = {}
    bands = bands or {}
    for name, values in series.items():
        policy = m.E2E_METRICS.get(name)
        if policy is None or name in m.NEVER_COMPARED or not policy.gated or not _group_enabled(policy, gates):
            continue
        band = bands.get(f"{lane}.{name}")
        if lane == "live" and policy.live:
            out[name] = _record(policy, name, list(values), Window(skip=skip_warmup, agg=policy.agg), band)
        elif lane == "replay" and policy.replay_per_step:
            for step, value in enumerate(values[:replay_steps]):
                out[f"{name}[{step}]"] = _record(policy, f"{name}[{step}]", value, None, band)
    return out


def scalar_records(scalars: Mapping[str, float], *, lane: Lane, gates: GateSelection) -> dict[str, MetricRecord]:
    """Run-level values (one number per arm, e.g. NVML peak memory): compared in the live lane."""
    out: dict[str, MetricRecord] = {}
    for name, value in scalars.items():
        policy = m.E2E_METRICS.get(name)
        if lane != "live" or policy is None or not policy.live or not policy.gated:
            continue
        if name not in m.NEVER_COMPARED and _group_enabled(policy, gates):
            out[name] = _record(policy, name, float(value), None)
    return out


def _fallback_comparison(kernels: Mapping[str, list[float]], extra_events: int) -> MetricComparison:
    values = kernels.get(m.FALLBACK_COUNT)
    if values is None:
        return MetricComparison(
            name=m.FALLBACK_COUNT, direction="lower_is_better", verdict=Verdict.MISSING_METRIC,
            detail="the kernel arm reported no fallback count: nothing shows the kernels ran",
        )
    worst = max(values, default=0.0)
    observed = (worst if math.isfinite(worst) else math.inf) + extra_events
    comparison = compare_value(
        m.FALLBACK_COUNT, 0.0, observed, direction="lower_is_better", band=m.FALLBACK_BAND
    )
    if comparison.verdict is Verdict.REGRESSION:
        detail = f"kernel arm fell back: max count {worst:g} over all steps, {extra_events} fallback log lines"
        comparison = comparison.model_copy(update={"detail": detail})
    return comparison


def gate_lane(
    baseline: Mapping[str, list[float]],
    kernels: Mapping[str, list[float]],
    *,
    case: str,
    platform: str,
    lane: Lane,
    skip_warmup: int,
    gates: GateSelection = GateSelection(),
    baseline_label: str = "baseline",
    kernels_label: str = "kernels",
    kernel_fallback_events: int = 0,
    baseline_scalars: Mapping[str, float] | None = None,
    kernels_scalars: Mapping[str, float] | None = None,
    bands: Mapping[str, Band] | None = None,
    replay_horizon: ReplayHorizon | None = None,
) -> LaneVerdict:
    """Gate one lane.

    `replay_horizon`: the replay lane compares steps 0 .. steps-1 only (the spec's
    `window.replay_horizon`); later steps are reported, and a note says so.

    `*_scalars` are run-level values (e.g. `peak_vram_mib` from the NVML poller: one number per
    arm); `kernel_fallback_events` adds fallbacks seen outside the series (log lines).
    """
    n_base = _check_series(baseline_label, baseline)
    n_kern = _check_series(kernels_label, kernels)
    steps = replay_horizon.steps if replay_horizon is not None else None
    a = lane_records(baseline, lane=lane, skip_warmup=skip_warmup, gates=gates, bands=bands, replay_steps=steps)
    b = lane_records(kernels, lane=lane, skip_warmup=skip_warmup, gates=gates, bands=bands, replay_steps=steps)
    a.update(scalar_records(baseline_scalars or {}, lane=lane, gates=gates))
    b.update(scalar_records(kernels_scalars or {}, lane=lane, gates=gates))
    rollouts = MetricRecord(name=ROLLOUTS_COMPLETED, value=0.0, direction="two_sided", space="count",
                            band=_ROLLOUTS_BAND)
    a[ROLLOUTS_COMPLETED] = rollouts.model_copy(update={"value": float(n_base)})
    b[ROLLOUTS_COMPLETED] = rollouts.model_copy(update={"value": float(n_kern)})
    empty_window: MetricComparison | None = None
    if lane == "live" and min(n_base, n_kern) <= skip_warmup:
        # Aggregating an empty window would raise: compare only the counts, and fail the lane.
        empty_window = MetricComparison(
            name="window", verdict=Verdict.MISSING_METRIC,
            detail=f"{min(n_base, n_kern)} rollouts leave nothing after {skip_warmup} warmup rollouts",
        )
        a = {k: v for k, v in a.items() if not v.is_series}
        b = {k: v for k, v in b.items() if not v.is_series}
    elif lane == "replay" and n_base != n_kern:
        # Per-step names exist only up to the shorter arm; the count comparison already fails.
        common = {name for name in a if name in b}
        a = {k: v for k, v in a.items() if k in common}
        b = {k: v for k, v in b.items() if k in common}
    result = compare_records(a, b, case=f"{case}/{lane}")
    if empty_window is not None:
        result.comparisons.append(empty_window)
    result.comparisons.append(_fallback_comparison(kernels, kernel_fallback_events))
    notes: list[str] = []
    if lane == "replay" and replay_horizon is not None and min(n_base, n_kern) > replay_horizon.steps:
        notes.append(f"replay steps {replay_horizon.steps}..{min(n_base, n_kern) - 1} reported, not gated "
                     f"(horizon {replay_horizon.steps} steps: {replay_horizon.source})")
    ignored = sorted(set(baseline) & set(kernels) & m.NEVER_COMPARED)
    if ignored:
        notes.append(f"not compared across arms: {', '.join(ignored)} (entropy is reported, never gated; vime's kernel arm does not compute it)")
    return LaneVerdict(case, platform, lane, baseline_label, kernels_label, result, notes)


def pair_verdict(lanes: list[LaneVerdict]) -> PairVerdict:
    if not lanes:
        raise ValueError("pair_verdict needs at least one lane verdict")
    keys = {(lane.case, lane.platform) for lane in lanes}
    if len(keys) != 1:
        raise ValueError(f"lane verdicts of different cases/platforms: {sorted(keys)}")
    case, platform = keys.pop()
    return PairVerdict(case, platform, list(lanes))
