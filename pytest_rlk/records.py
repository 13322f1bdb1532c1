"""A test's record (``TestRecord``) from its pytest item and phase reports, and the provenance
the gate writes into baselines."""
from __future__ import annotations

from pytest_rlk import platform as rlk_platform
from pytest_rlk import sharding, storage
from pytest_rlk.failures import report_failure
from pytest_rlk.gate import provenance_of
from pytest_rlk.recorder import case_from_nodeid
from pytest_rlk.schema import TestRecord
from pytest_rlk.state import BACKEND_SEEN, GATE, GATE_ERROR, RECORDER, STATE, TIER, UNSERVED, RlkState


def build_test_record(item, outcome: str, *, duration: float = 0.0, skip_reason: str | None = None,
                      failure: str | None = None) -> TestRecord:
    state = item.config.stash[STATE]
    recorder = item.stash.get(RECORDER, None)
    record = TestRecord(nodeid=item.nodeid, case=recorder.case if recorder else case_from_nodeid(item.nodeid),
                        tier=item.stash.get(TIER, None), outcome=outcome, duration_s=duration,
                        skip_reason=skip_reason, failure=failure, unserved=UNSERVED in item.stash,
                        worker=state.worker or "main", gate_error=item.stash.get(GATE_ERROR, None))
    gpus = max(sharding.gpus_needed((m.name, m.args) for m in item.iter_markers()),
               recorder.gpus if recorder is not None else 1)
    if gpus > 1:
        record.baseline_platform = rlk_platform.baseline_platform(state.platform.tag, gpus)
    fault = item.get_closest_marker("injected_fault")
    if fault is not None:
        record.injected_fault = str(fault.args[0]) if fault.args else "injected fault"
    seen = item.stash.get(BACKEND_SEEN, None)
    record.backends = [seen] if seen is not None else []
    if recorder is not None:
        record.metrics = list(recorder.metrics.values())
        record.seeds = dict(recorder.seeds)
        record.fallback_counts = dict(recorder.fallback_counts)
        record.backends += [b for b in recorder.backends if b not in record.backends]
        used = recorder.artifact_dir_if_used
        record.artifact_dir = str(used) if used is not None else None
    gate = item.stash.get(GATE, None)
    if gate is not None:
        record.gate = gate
    return record


def provenance(state: RlkState) -> dict[str, object]:
    if state.provenance is None:
        if state.run_dir is not None:
            manifest = storage.load_run(state.run_dir / storage.RUN_FILE).manifest
            state.provenance = provenance_of(manifest, state.platform)
        else:
            state.provenance = {"platform": state.platform.model_dump(exclude={"devices"})}
    return state.provenance


def skip_reason_of(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


def record_from_phases(item, phases: dict) -> TestRecord:
    setup, call, teardown = phases.get("setup"), phases.get("call"), phases.get("teardown")
    duration = sum(r.duration for r in phases.values())
    skip_reason = None
    failure = "\n".join(m for m in (report_failure(r) for r in phases.values()) if m) or None
    if setup is not None and setup.failed or teardown is not None and teardown.failed:
        outcome = "error"
    elif call is not None and call.failed:
        outcome = "failed"
    elif any(r.skipped for r in phases.values()):
        outcome = "skipped"
        skip_reason = skip_reason_of(next(r for r in phases.values() if r.skipped))
    else:
        outcome = "passed"
    return build_test_record(item, outcome, duration=duration, skip_reason=skip_reason, failure=failure)
