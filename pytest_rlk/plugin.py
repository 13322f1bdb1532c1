"""pytest hooks of pytest-rlk (thin: the logic lives in the plain modules beside this one).

Exit status: pytest's own rules apply. ``pytest --rlk-tier=e2e -m h200`` on a CPU machine exits 0
because the h200 tests are collected and *skipped* with reasons (never deselected); likewise a
tier skipped at collection with its reason (its conftest needs torch, missing here) exits 0, with
the reason in the rlk section. Exit 5 ("no tests collected") stays for a selection that matches
nothing or deselects what was there, a real error in a CI command line (``skips.exit_status``).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from pytest_rlk import hookspec, markers, options, records, shard_hooks, sharding, skips, storage
from pytest_rlk import platform as rlk_platform
from pytest_rlk import session as rlk_session
from pytest_rlk._kernels_guard import check_imported_kernels
from pytest_rlk.gate import GateSettings, gate_test
from pytest_rlk.manifest import build_manifest, new_run_id, switched_on_backend_id
from pytest_rlk.progress import Progress
from pytest_rlk.recorder import MetricRecorder, case_from_nodeid
from pytest_rlk.schema import PlatformInfo, TestRecord
from pytest_rlk.session import RunFiles
from pytest_rlk.state import (
    BACKEND_SEEN, GATE, GATE_ERROR, MARKER_ERROR, NODE_PLATFORM, PHASES, RECORDER, STATE, TIER, UNSERVED,
    RlkState,
)
from pytest_rlk.table import summary_lines


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(hookspec)


def pytest_addoption(parser):
    group = parser.getgroup("rlk", "pytest-rlk: RL kernel validation, metrics and baselines")
    group.addoption("--rlk-tier", default=None, help="comma list of tiers to run: op,module,e2e,plugin (plugin: the "
                    "plugin's own tests; default: the tiers of the paths given where each lies in suites/<tier>/, else op)")
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
    group.addoption("--rlk-shard-gpus", action="store_true", default=False, help="with -n auto (or -n N): one xdist worker per GPU, each pinned to its GPU (CUDA_VISIBLE_DEVICES); tests marked gpus(n>1) run afterwards in an all-GPU phase, alone")
    group.addoption("--rlk-workers-per-gpu", metavar="K", default=None, help="with --rlk-shard-gpus: K xdist workers share each GPU (-n auto starts K per GPU); benchmarks and tests marked exclusive_gpu wait for the serial phase, alone on the node (default 1)")
    group.addoption("--rlk-all-gpu-phase", metavar="RUN_DIR", default=None, help=argparse.SUPPRESS)  # set by the controller of a --rlk-shard-gpus run


def _node_platform(config, override: str | None) -> PlatformInfo:
    """This machine's platform, detected once per process (the xdist worker count asks early)."""
    if NODE_PLATFORM not in config.stash:
        plat = config.hook.pytest_rlk_platform(config=config) or rlk_platform.detect()
        config.stash[NODE_PLATFORM] = rlk_platform.with_override(plat, override)
    return config.stash[NODE_PLATFORM]


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto --rlk-shard-gpus``: one worker per GPU (``--rlk-workers-per-gpu K``: K per GPU)."""
    if not config.getoption("rlk_shard_gpus", False) or config.getoption("rlk_all_gpu_phase", None):
        return None
    try:
        platform = _node_platform(config, options.parse_platform(config.getoption("rlk_platform")))
        per_gpu = options.parse_workers_per_gpu(config.getoption("rlk_workers_per_gpu", None), True)
        return per_gpu * len(sharding.node_gpu_ids(platform, os.environ, sharding.fake_gpu_count())) or None
    except (options.OptionError, sharding.ShardError) as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_configure(config):
    for line in markers.marker_lines():
        config.addinivalue_line("markers", line)
    try:
        options.check_rootdir_not_taken(list(config.invocation_params.args), Path(config.invocation_params.dir),
                                        config.inipath)
        opts = options.build_options(config.getoption, Path(config.rootpath), list(config.args),
                                     invocation_dir=Path(config.invocation_params.dir))
    except options.OptionError as exc:
        raise pytest.UsageError(str(exc)) from None
    workerinput = getattr(config, "workerinput", None)
    if workerinput and "rlk_platform" in workerinput:  # the controller detected it already
        plat = PlatformInfo.model_validate_json(workerinput["rlk_platform"])
    else:
        plat = _node_platform(config, opts.platform_override)
    if opts.backend is not None and not workerinput:
        _check_backend_loads(opts.backend, plat)
    state = RlkState(opts=opts, platform=plat, worker=workerinput["workerid"] if workerinput else None)
    if workerinput and workerinput.get("rlk_run_dir"):
        state.run_dir = Path(workerinput["rlk_run_dir"])
    shard_hooks.configure_sharding(config, state, workerinput)
    if opts.backend is not None:
        state.saved_backend_env = (options.BACKEND_ENV in os.environ, os.environ.get(options.BACKEND_ENV))
        os.environ[options.BACKEND_ENV] = opts.backend
    config.stash[STATE] = state
    if state.worker is None and state.signals.install():
        config.pluginmanager.register(state.signals, "rlk-stop-signals")  # its pytest_keyboard_interrupt
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(), "rlk-xdist")


@pytest.hookimpl(trylast=True, specname="pytest_configure")
def pytest_configure_check_marker_expression(config):
    """Once every plugin and the root conftest registered their markers (so before a run
    directory exists): ``-m`` naming an unregistered marker selects nothing, silently; a usage error."""
    if config.option.markexpr:
        error = markers.unknown_marker_error(config.option.markexpr,
                                             markers.registered_names(config.getini("markers")))
        if error:
            raise pytest.UsageError(error)


def _check_backend_loads(name: str, plat: PlatformInfo) -> None:
    """Without a GPU, Triton kernels run through its interpreter, which must be on before a
    backend module defines them (the op and module tiers' conftests set the same)."""
    if plat.detected_tag == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        options.load_backend(name)
    except options.OptionError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_unconfigure(config):
    state = config.stash.get(STATE, None)
    if state is not None:
        state.signals.restore()
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
        manifest.gpu_shards = dict(state.gpu_shards)
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


def pytest_report_header(config):
    """The run directory, and how to finish it should the process die before its summary."""
    state = config.stash.get(STATE, None)
    if state is None or state.worker is not None or state.run_dir is None:
        return None
    return [f"rlk: run {state.run_dir} (should this process die before its summary: "
            f"rlk merge {state.run_dir}, then rlk report {state.run_dir})"]


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


@pytest.hookimpl(tryfirst=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_hardware_marks(config, items):
    """Skips from the tests' own markers, then every test gets the hardware marks of every
    platform it can run on (``markers.runnable_on``), before pytest's ``-m`` filter runs: ``-m
    h100`` on any machine selects what an H100 node runs, and this machine skips what it
    cannot serve, with the reason. A ``-m`` that does not name ``bench_full`` deselects those tests
    (``markers.leaves_out_bench_full``)."""
    state = config.stash[STATE]
    ctx = markers.ServeContext(platform=state.platform, vime_root=state.opts.vime_root,
                               model_root=state.opts.model_root)
    for item in items:
        own = {m.name for m in item.iter_markers()}
        _skip_if_unserved(item, ctx)
        for name in markers.runnable_on(own):
            if name not in own:
                item.add_marker(name)
    if markers.leaves_out_bench_full(config.option.markexpr):
        # labelled variants and long benchmarks are a job of their own (-m bench_full)
        drop = [item for item in items if item.get_closest_marker("bench_full") is not None]
        if drop:
            items[:] = [item for item in items if item.get_closest_marker("bench_full") is None]
            config.hook.pytest_deselected(items=drop)


def pytest_collection_modifyitems(config, items):
    try:
        check_imported_kernels()
    except ImportError as exc:
        raise pytest.UsageError(str(exc)) from None
    state = config.stash[STATE]
    root = Path(config.rootpath)
    keep, drop = [], []
    for item in items:
        path = Path(item.path)
        rel = path.relative_to(root) if path.is_relative_to(root) else path
        tier = markers.tier_of(rel, (m.name for m in item.iter_markers()))
        item.stash[TIER] = tier
        if tier is None or tier in state.opts.tiers:
            keep.append(item)
        else:
            drop.append(item)
            state.deselected[tier] = state.deselected.get(tier, 0) + 1
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if state.writer is not None:
        state.writer.set_deselected(state.deselected)


def pytest_deselected(items):
    """Counts what ``-m`` / ``-k`` deselected of the selected tiers (the tier deselection is
    counted where it happens), so the summary says what the selection left out."""
    for item in items:
        state = item.config.stash.get(STATE, None)
        if state is not None and markers.tier_of(Path(item.path), (m.name for m in item.iter_markers())) \
                in (*state.opts.tiers, None):
            state.deselected_by_selection += 1


def pytest_collection_finish(session):
    state = session.config.stash.get(STATE, None)
    if state is not None and state.writer is not None:
        state.writer.set_collected(len(session.items))


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
    item.config.stash[STATE].current_test = item.nodeid  # progress lines name it
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


@pytest.fixture(scope="session")
def rlk_progress(request) -> Progress:
    """Progress of long steps on the terminal: ``rlk_progress("...")`` or ``with rlk_progress.step("...")``."""
    return Progress(request.config)


@pytest.fixture(scope="session")
def rlk_files(request) -> RunFiles:
    """Files of the run as a whole: ``rlk_files.path("table.txt", "backend parity table")``."""
    return RunFiles(request.config.stash[STATE])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        result = yield  # raises (and skips the gate) when the test body failed
    finally:
        _note_switched_on_backend(item)
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
    record = records.build_test_record(item, "passed")
    settings = GateSettings(baselines=opts.baselines, platform=record.gated_platform(state.platform.tag),
                            update=opts.update_baselines, require=opts.require_baselines,
                            refresh_rel=opts.refresh_rel, fail_on_improvement=opts.fail_on_improvement)
    try:
        outcome = gate_test(record, settings, records.provenance(state))
    except (storage.RlkFileError, ValueError) as exc:
        item.stash[GATE_ERROR] = str(exc)
        outcome = None
    if outcome is None:  # failed outside the except block: the message once, no chained traceback
        pytest.fail(f"rlk gate error: {item.stash[GATE_ERROR]}", pytrace=False)
    item.stash[GATE] = outcome.result
    if outcome.failure:
        pytest.fail(outcome.failure, pytrace=False)
    return result


def _note_switched_on_backend(item) -> None:
    """The kernel backend switched on as the test body ends (its fixtures still set), if any."""
    backend = switched_on_backend_id()
    if backend is not None:
        item.stash[BACKEND_SEEN] = backend


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    phases = item.stash.setdefault(PHASES, {})
    phases[call.when] = report
    if call.when == "teardown":
        state = item.config.stash[STATE]
        if state.writer is not None:
            state.writer.add(records.record_from_phases(item, phases))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module skipped at collection (``pytest.importorskip`` at its top) is one skip in
    pytest's count: the run records it too, so the summary's skips add up to pytest's."""
    report = yield
    state = collector.config.stash.get(STATE, None)
    if not (report.skipped and report.nodeid and state is not None):
        return report
    why = records.skip_reason_of(report)
    state.collection_skips.append((report.nodeid, why))
    if state.writer is not None:
        state.writer.add(TestRecord(
            nodeid=report.nodeid, case=case_from_nodeid(report.nodeid),
            tier=markers.tier_of(Path(report.nodeid), ()), outcome="skipped",
            skip_reason=why, worker=state.worker or "main"))
    return report


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    state = config.stash.get(STATE, None)
    if state is not None:
        deselected = state.deselected_by_selection + sum(state.deselected.values())
        session.exitstatus = exitstatus = skips.exit_status(exitstatus, len(state.collection_skips), deselected)
    if state is None or state.worker is not None or state.run_dir is None or config.option.collectonly:
        return
    state.signals.finishing()
    if exitstatus == pytest.ExitCode.USAGE_ERROR and rlk_session.discard_run_without_results(state.run_dir):
        state.run_dir = None  # a usage error found during collection: no run to report
        return
    status = "interrupted" if exitstatus == pytest.ExitCode.INTERRUPTED else "complete"
    state.run = rlk_session.merge_run(state.run_dir, status=status, exit_status=int(exitstatus))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The rlk section comes after pytest's own summaries (the terminal reporter prints its short
    test summary as its wrapper unwinds, inside this one): the verdict, the artifacts and the
    commands to report are the last lines above pytest's count."""
    result = yield
    state = config.stash.get(STATE, None)
    if state is not None and state.collection_skips and config.option.collectonly:  # no run: say what was skipped
        terminalreporter.section("rlk")
        for nodeid, why in state.collection_skips:
            terminalreporter.write_line(f"skipped at collection: {nodeid}: {why}")
    if state is None or state.run is None:
        return result
    run = state.run
    terminalreporter.section("rlk")
    selection = (config.option.markexpr, config.option.keyword)
    for line in summary_lines(run, state.run_dir, state.opts.tiers, not_collected=state.not_collected,
                              deselected_by=(selection, state.deselected_by_selection)):
        terminalreporter.write_line(line)
    for extra in config.hook.pytest_rlk_summary(config=config, run=run):
        for line in extra or ():
            terminalreporter.write_line(line)
    return result
