"""pytest hooks of pytest-rlk (thin: the logic lives in the plain modules beside this one).

Exit status: pytest's own rules apply. ``pytest --rlk-tier=e2e -m h200`` on a CPU machine exits 0
because the h200 tests are collected and *skipped* with reasons (never deselected); exit 5 ("no
tests collected") is left untouched, because a selection that matches nothing is a real error
in a CI command line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_rlk import hookspec, markers, options, storage
from pytest_rlk import platform as rlk_platform
from pytest_rlk import session as rlk_session
from pytest_rlk._kernels_guard import check_imported_kernels
from pytest_rlk.failures import report_failure
from pytest_rlk.gate import GateSettings, gate_test
from pytest_rlk.manifest import build_manifest, new_run_id
from pytest_rlk.recorder import MetricRecorder, case_from_nodeid
from pytest_rlk.schema import PlatformInfo, RunRecord, TestRecord
from pytest_rlk.table import summary_lines


@dataclass
class RlkState:
    opts: options.RlkOptions
    platform: PlatformInfo
    worker: str | None  # xdist worker id; None in the controller / single process
    run_dir: Path | None = None
    writer: rlk_session.PartWriter | None = None
    provenance: dict[str, object] | None = None
    run: RunRecord | None = None
    saved_backend_env: tuple[bool, str | None] = (False, None)
    deselected: dict[str, int] = field(default_factory=dict)
    gated_cases: dict[tuple[str | None, str], str] = field(default_factory=dict)  # -> nodeid
    not_collected: dict[str, str] = field(default_factory=dict)  # tier -> its suites/<tier> dir


STATE = pytest.StashKey[RlkState]()
RECORDER = pytest.StashKey[MetricRecorder]()
TIER = pytest.StashKey[str | None]()
PHASES = pytest.StashKey[dict]()
GATE = pytest.StashKey[object]()
UNSERVED = pytest.StashKey[str]()
MARKER_ERROR = pytest.StashKey[str]()


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(hookspec)


def pytest_addoption(parser):
    group = parser.getgroup("rlk", "pytest-rlk: RL kernel validation, metrics and baselines")
    group.addoption("--rlk-tier", default="op", help="comma list of tiers to run: op,module,e2e (default: op)")
    group.addoption("--rlk-artifacts", metavar="DIR", default=None, help="run files go to DIR/<run_id>/ (default: .rlk/runs under rootdir)")
    group.addoption("--rlk-baselines", metavar="DIR", default=None, help="baseline directory (default: baselines/ under rootdir)")
    group.addoption("--rlk-update-baselines", metavar="failed|all", default=None, help="failed: rewrite failing baselines (the tests still fail); all: rewrite every baseline touched (passes)")
    group.addoption("--rlk-require-baselines", action="store_true", default=False, help="a missing baseline fails the test (nightly mode)")
    group.addoption("--rlk-platform", metavar="TAG", default=None, help="override the detected platform tag (h100, h200, a100, gb200, other-gpu, cpu); cpu also hides the GPUs from the marker checks")
    group.addoption("--rlk-vime-root", metavar="PATH", default=None, help="a vime checkout (its commit is recorded; enables vime tests)")
    group.addoption("--rlk-vime-fork-root", metavar="PATH", default=None, help="a checkout of the RL-Align vime fork (enables the vime_fork conformance tests)")
    group.addoption("--rlk-model-root", metavar="DIR", default=None, help="directory holding model checkpoints for the model markers")
    group.addoption("--rlk-refresh-rel", metavar="X", default=None, help="flag a value better than its baseline by more than max(X*|ref|, abs_floor) as 'refresh the baseline' (default: the metric's band)")
    group.addoption("--rlk-fail-on-improvement", action="store_true", default=False, help="fail tests whose metrics improved beyond the refresh band")
    group.addoption("--rlk-backend", metavar="ID", default=None, help="kernel backend id or 'pkg.module:factory' (exported as VIME_RL_KERNEL_BACKEND)")


def pytest_configure(config):
    for line in markers.marker_lines():
        config.addinivalue_line("markers", line)
    try:
        opts = options.build_options(config.getoption, Path(config.rootpath))
    except options.OptionError as exc:
        raise pytest.UsageError(str(exc)) from None
    workerinput = getattr(config, "workerinput", None)
    if workerinput and "rlk_platform" in workerinput:  # the controller detected it already
        plat = PlatformInfo.model_validate_json(workerinput["rlk_platform"])
    else:
        plat = config.hook.pytest_rlk_platform(config=config) or rlk_platform.detect()
        plat = rlk_platform.with_override(plat, opts.platform_override)
    state = RlkState(opts=opts, platform=plat, worker=workerinput["workerid"] if workerinput else None)
    if workerinput and workerinput.get("rlk_run_dir"):
        state.run_dir = Path(workerinput["rlk_run_dir"])
    if opts.backend is not None:
        state.saved_backend_env = (options.BACKEND_ENV in os.environ, os.environ.get(options.BACKEND_ENV))
        os.environ[options.BACKEND_ENV] = opts.backend
    config.stash[STATE] = state
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(), "rlk-xdist")


def pytest_unconfigure(config):
    state = config.stash.get(STATE, None)
    if state is not None and state.opts.backend is not None:
        had, value = state.saved_backend_env
        if had:
            os.environ[options.BACKEND_ENV] = value
        else:
            os.environ.pop(options.BACKEND_ENV, None)


def _ensure_run(config) -> Path:
    """The controller creates the run directory once (also called from xdist's node setup)."""
    state = config.stash[STATE]
    if state.run_dir is None:
        manifest = build_manifest(
            run_id=new_run_id(), argv=list(config.invocation_params.args), tiers=state.opts.tiers,
            platform=state.platform, suite_root=Path(config.rootpath), vime_root=state.opts.vime_root,
            backend_option=state.opts.backend)
        state.run_dir = rlk_session.start_run(state.opts.artifacts, manifest)
    return state.run_dir


class _XdistHooks:
    def pytest_configure_node(self, node):
        node.workerinput["rlk_run_dir"] = str(_ensure_run(node.config))
        node.workerinput["rlk_platform"] = node.config.stash[STATE].platform.model_dump_json()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    config = session.config
    if config.option.collectonly:
        return
    state = config.stash[STATE]
    run_dir = _ensure_run(config) if state.worker is None else state.run_dir
    if run_dir is not None and not config.pluginmanager.hasplugin("dsession"):
        state.writer = rlk_session.PartWriter(run_dir, state.worker or "main")
        state.writer.flush()


def pytest_ignore_collect(collection_path, config):
    """``suites/<tier>/`` of an unselected tier is not collected at all: importing its modules
    (torch, transformers, trl, ...) would cost collection time for tests deselected anyway.
    Not when a path given on the command line lies inside it: those are collected and
    deselected as before, so the summary names them."""
    tier = markers.tier_of_dir(collection_path)
    state = config.stash.get(STATE, None)
    if tier is None or state is None or tier in state.opts.tiers or not collection_path.is_dir():
        return None
    given = [Path(config.invocation_params.dir, arg.split("::")[0]).resolve() for arg in config.args]
    if any(path.is_relative_to(collection_path) for path in given):
        return None
    if not any(collection_path.is_relative_to(path) for path in given):
        return None  # not asked for (pytest only looks at it on the way): nothing to report
    root = Path(config.rootpath)
    rel = collection_path.relative_to(root) if collection_path.is_relative_to(root) else collection_path
    state.not_collected[tier] = str(rel)
    return True


def pytest_collection_modifyitems(config, items):
    try:
        check_imported_kernels()
    except ImportError as exc:
        raise pytest.UsageError(str(exc)) from None
    state = config.stash[STATE]
    root = Path(config.rootpath)
    ctx = markers.ServeContext(platform=state.platform, vime_root=state.opts.vime_root,
                               model_root=state.opts.model_root)
    keep, drop = [], []
    for item in items:
        path = Path(item.path)
        rel = path.relative_to(root) if path.is_relative_to(root) else path
        tier = markers.tier_of(rel, (m.name for m in item.iter_markers()))
        item.stash[TIER] = tier
        if tier is None or tier in state.opts.tiers:
            keep.append(item)
            _skip_if_unserved(item, ctx)
        else:
            drop.append(item)
            state.deselected[tier] = state.deselected.get(tier, 0) + 1
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if state.writer is not None:
        state.writer.set_deselected(state.deselected)


def _skip_if_unserved(item, ctx: markers.ServeContext) -> None:
    """A skip marker (not a skip call) so pytest reports the test's own location."""
    try:
        reason = markers.unserved_reason(((m.name, m.args) for m in item.iter_markers()), ctx)
    except ValueError as exc:
        item.stash[MARKER_ERROR] = str(exc)  # fails the test in setup, with this message
        return
    if reason:
        item.stash[UNSERVED] = reason
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    error = item.stash.get(MARKER_ERROR, None)
    if error is not None:
        pytest.fail(f"{item.nodeid}: {error}", pytrace=False)


@pytest.fixture
def rlk_metrics(request) -> MetricRecorder:
    """Record metrics, seeds and fallback counts for this test; gated after the test body."""
    state = request.config.stash[STATE]
    node = request.node
    artifact_root = state.run_dir / rlk_session.TESTS if state.run_dir is not None else None
    recorder = MetricRecorder(node.nodeid, tier=node.stash.get(TIER, None), artifact_root=artifact_root)
    node.stash[RECORDER] = recorder
    return recorder


def _test_record(item, outcome: str, *, duration: float = 0.0, skip_reason: str | None = None,
                 failure: str | None = None) -> TestRecord:
    state = item.config.stash[STATE]
    recorder = item.stash.get(RECORDER, None)
    record = TestRecord(nodeid=item.nodeid, case=recorder.case if recorder else case_from_nodeid(item.nodeid),
                        tier=item.stash.get(TIER, None), outcome=outcome, duration_s=duration,
                        skip_reason=skip_reason, failure=failure, unserved=UNSERVED in item.stash,
                        worker=state.worker or "main")
    if recorder is not None:
        record.metrics = list(recorder.metrics.values())
        record.seeds = dict(recorder.seeds)
        record.fallback_counts = dict(recorder.fallback_counts)
        used = recorder.artifact_dir_if_used
        record.artifact_dir = str(used) if used is not None else None
    gate = item.stash.get(GATE, None)
    if gate is not None:
        record.gate = gate
    return record


def _provenance(state: RlkState) -> dict[str, object]:
    if state.provenance is None:
        prov: dict[str, object] = {}
        if state.run_dir is not None:
            m = storage.load_run(state.run_dir / storage.RUN_FILE).manifest
            prov = {"run_id": m.run_id, "created_utc": m.created_utc, "suite_commit": m.suite_commit,
                    "suite_dirty": m.suite_dirty, "vime_commit": m.vime_commit,
                    "kernel_backend_ids": m.kernel_backend_ids,
                    "software": {k: v for k, v in m.software.items() if v is not None}}
        prov["platform"] = state.platform.model_dump(exclude={"devices"})
        state.provenance = prov
    return state.provenance


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield  # raises (and skips the gate) when the test body failed
    recorder = item.stash.get(RECORDER, None)
    if recorder is None or not any(m.gate for m in recorder.metrics.values()):
        return result
    state = item.config.stash[STATE]
    key = (item.stash.get(TIER, None), recorder.case)
    owner = state.gated_cases.setdefault(key, item.nodeid)
    if owner != item.nodeid:
        pytest.fail(f"rlk: case {recorder.case!r} is gated by {owner} already; each test needs its "
                    "own case (it names the baseline file): use rlk_metrics.set_case(...)", pytrace=False)
    opts = state.opts
    settings = GateSettings(baselines=opts.baselines, platform=state.platform.tag,
                            update=opts.update_baselines, require=opts.require_baselines,
                            refresh_rel=opts.refresh_rel, fail_on_improvement=opts.fail_on_improvement)
    try:
        outcome = gate_test(_test_record(item, "passed"), settings, _provenance(state))
    except (storage.RlkFileError, ValueError) as exc:
        pytest.fail(f"rlk gate error: {exc}", pytrace=False)
    item.stash[GATE] = outcome.result
    if outcome.failure:
        pytest.fail(outcome.failure, pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    phases = item.stash.setdefault(PHASES, {})
    phases[call.when] = report
    if call.when == "teardown":
        state = item.config.stash[STATE]
        if state.writer is not None:
            state.writer.add(_record_from_phases(item, phases))
    return report


def _record_from_phases(item, phases: dict) -> TestRecord:
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
        rep = next(r for r in phases.values() if r.skipped)
        skip_reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        skip_reason = skip_reason.removeprefix("Skipped: ")
    else:
        outcome = "passed"
    return _test_record(item, outcome, duration=duration, skip_reason=skip_reason, failure=failure)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    state = config.stash.get(STATE, None)
    if state is None or state.worker is not None or state.run_dir is None or config.option.collectonly:
        return
    status = "interrupted" if exitstatus == pytest.ExitCode.INTERRUPTED else "complete"
    state.run = rlk_session.merge_run(state.run_dir, status=status, exit_status=int(exitstatus))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = config.stash.get(STATE, None)
    if state is None or state.run is None:
        return
    run = state.run
    terminalreporter.section("rlk")
    for line in summary_lines(run, state.run_dir, state.opts.tiers, not_collected=state.not_collected):
        terminalreporter.write_line(line)
    for extra in config.hook.pytest_rlk_summary(config=config, run=run):
        for line in extra or ():
            terminalreporter.write_line(line)
