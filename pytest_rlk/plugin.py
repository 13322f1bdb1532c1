"""pytest hooks of pytest-rlk (thin: the logic lives in the plain modules beside this one).

Exit status: pytest's own rules apply. ``pytest --rlk-tier=e2e -m h200`` on a CPU machine exits 0
because the h200 tests are collected and *skipped* with reasons (never deselected); exit 5 ("no
tests collected") is left untouched, because a selection that matches nothing is a real error
in a CI command line.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_rlk import hookspec, markers, options, sharding, storage
from pytest_rlk import platform as rlk_platform
from pytest_rlk import session as rlk_session
from pytest_rlk.signals import StopSignals
from pytest_rlk._kernels_guard import check_imported_kernels
from pytest_rlk.failures import report_failure
from pytest_rlk.gate import GateSettings, gate_test
from pytest_rlk.manifest import build_manifest, new_run_id, switched_on_backend_id
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
    current_test: str | None = None  # the test being set up or run (named by progress lines)
    gpu_shards: dict[str, str] = field(default_factory=dict)  # --rlk-shard-gpus: worker -> its GPUs
    signals: StopSignals = field(default_factory=StopSignals)


STATE = pytest.StashKey[RlkState]()
RECORDER = pytest.StashKey[MetricRecorder]()
TIER = pytest.StashKey[str | None]()
PHASES = pytest.StashKey[dict]()
GATE = pytest.StashKey[object]()
GATE_ERROR = pytest.StashKey[str]()
BACKEND_SEEN = pytest.StashKey[str]()
UNSERVED = pytest.StashKey[str]()
MARKER_ERROR = pytest.StashKey[str]()
NODE_PLATFORM = pytest.StashKey[PlatformInfo]()


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(hookspec)


def pytest_addoption(parser):
    group = parser.getgroup("rlk", "pytest-rlk: RL kernel validation, metrics and baselines")
    group.addoption("--rlk-tier", default="op", help="comma list of tiers to run: op,module,e2e,plugin (plugin: the plugin's own tests; default: op)")
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
    group.addoption("--rlk-all-gpu-phase", metavar="RUN_DIR", default=None, help=argparse.SUPPRESS)  # set by the controller of a --rlk-shard-gpus run


def _node_platform(config, override: str | None) -> PlatformInfo:
    """This machine's platform, detected once per process (the xdist worker count asks early)."""
    if NODE_PLATFORM not in config.stash:
        plat = config.hook.pytest_rlk_platform(config=config) or rlk_platform.detect()
        config.stash[NODE_PLATFORM] = rlk_platform.with_override(plat, override)
    return config.stash[NODE_PLATFORM]


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto --rlk-shard-gpus``: one worker per GPU."""
    if not config.getoption("rlk_shard_gpus", False) or config.getoption("rlk_all_gpu_phase", None):
        return None
    try:
        platform = _node_platform(config, options.parse_platform(config.getoption("rlk_platform")))
        return len(sharding.node_gpu_ids(platform, os.environ, sharding.fake_gpu_count())) or None
    except (options.OptionError, sharding.ShardError) as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_configure(config):
    for line in markers.marker_lines():
        config.addinivalue_line("markers", line)
    try:
        options.check_rootdir_not_taken(list(config.invocation_params.args), Path(config.invocation_params.dir),
                                        config.inipath)
        opts = options.build_options(config.getoption, Path(config.rootpath))
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
    _configure_sharding(config, state, workerinput)
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


def _configure_sharding(config, state: RlkState, workerinput: dict | None) -> None:
    """``--rlk-shard-gpus`` (its controller and workers) and the all-GPU phase that follows it."""
    opts = state.opts
    if opts.all_gpu_phase is None and not opts.shard_gpus:
        return
    try:
        if opts.all_gpu_phase is not None:
            state.worker, state.run_dir = sharding.ALL_GPU_WORKER, opts.all_gpu_phase
            hooks = _AllGpuPhaseHooks(sharding.read_nodeids(opts.all_gpu_phase))
        elif workerinput is not None:
            sharding.check_worker(workerinput, os.environ, config.inipath)
            hooks = _ShardWorkerHooks()
        else:
            sharding.check_xdist(config.pluginmanager.hasplugin("xdist"))
            config.option.tx, state.gpu_shards = sharding.pin_workers(
                config.option.tx, state.platform, os.environ, config.invocation_params.args)
            hooks = _ShardControllerHooks(state)
    except sharding.ShardError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.pluginmanager.register(hooks, "rlk-shard-gpus")


def _held_back(items: list) -> list:
    """Remove the tests that wait for the all-GPU phase from ``items``; returns them."""
    keep, held = sharding.split_held_back(
        items, lambda item: ([(m.name, m.args) for m in item.iter_markers()], UNSERVED in item.stash))
    items[:] = keep
    return held


class _ShardWorkerHooks:
    """An xdist worker pinned to one GPU: it leaves the multi-GPU tests to the all-GPU phase."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        config.workeroutput[sharding.WORKEROUTPUT_KEY] = [item.nodeid for item in _held_back(items)]


class _AllGpuPhaseHooks:
    """The all-GPU phase: only the tests the workers left to it."""

    def __init__(self, nodeids: list[str]) -> None:
        self.nodeids = set(nodeids)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        drop = [item for item in items if item.nodeid not in self.nodeids]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [item for item in items if item.nodeid in self.nodeids]


class _ShardControllerHooks:
    """Pins each worker to its GPU, then runs the all-GPU phase once the workers are done."""

    def __init__(self, state: RlkState) -> None:
        self.state = state
        self.held: dict[str, None] = {}  # nodeids, in the order the workers reported them

    def pytest_configure_node(self, node):
        node.workerinput.update(sharding.worker_input(node.gateway.spec.env, node.config.inipath))

    def pytest_testnodedown(self, node, error):
        self.held.update(dict.fromkeys(getattr(node, "workeroutput", {}).get(sharding.WORKEROUTPUT_KEY, ())))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session):
        result = yield  # the workers' phase; raises when it was stopped (-x, Ctrl-C)
        if self.held and self.state.run_dir is not None and not session.shouldfail and not session.shouldstop:
            config = session.config
            session.testsfailed += sharding.run_all_gpu_phase(
                list(self.held), self.state.run_dir, invocation_args=config.invocation_params.args,
                cwd=config.invocation_params.dir, gpus=self.state.gpu_shards[sharding.ALL_GPU_WORKER],
                say=config.get_terminal_writer().line)
        return result


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
    return [f"rlk: run {state.run_dir}; stopped before its summary (killed): rlk merge {state.run_dir}, "
            "then rlk report"]


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
    cannot serve, with the reason."""
    state = config.stash[STATE]
    ctx = markers.ServeContext(platform=state.platform, vime_root=state.opts.vime_root,
                               model_root=state.opts.model_root)
    for item in items:
        own = {m.name for m in item.iter_markers()}
        _skip_if_unserved(item, ctx)
        for name in markers.runnable_on(own):
            if name not in own:
                item.add_marker(name)


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


class Progress:
    """Progress lines of a long step on the terminal (through pytest's terminal reporter, with
    capture suspended for the line), so a minute of vLLM start-up or a TRL A/B is not silence:
    ``rlk: <test>: <message>``. Silent under ``-qq`` and in xdist workers (no terminal)."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config

    def __call__(self, message: str) -> None:
        config = self._config
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or config.get_verbosity() < -1 or hasattr(config, "workerinput"):
            return
        current = config.stash[STATE].current_test
        where = f"{current.split('::', 1)[-1]}: " if current else ""
        capture = config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            writer = getattr(reporter, "_tw", None)  # under -q the progress dots leave the line open
            if writer is not None and writer.width_of_current_line:
                reporter.write("\n")
            reporter.ensure_newline()
            reporter.write_line(f"rlk: {where}{message}")

    @contextlib.contextmanager
    def step(self, message: str):
        """``with rlk_progress.step("vLLM: start the engine, generate"):`` a line when it starts,
        one when it ends, with its duration (or that it failed)."""
        start = time.monotonic()
        self(f"{message} ...")
        try:
            yield
        except BaseException:
            self(f"{message}: failed after {time.monotonic() - start:.0f} s")
            raise
        self(f"{message}: done in {time.monotonic() - start:.0f} s")


@pytest.fixture(scope="session")
def rlk_progress(request) -> Progress:
    """Progress of long steps on the terminal: ``rlk_progress("...")`` or ``with rlk_progress.step("...")``."""
    return Progress(request.config)


class RunFiles:
    """Files of the whole run (not of one test): ``DIR/<run_id>/files/<name>``, each named with
    its description in the rlk summary and the report (e.g. a table several tests fill)."""

    def __init__(self, state: RlkState) -> None:
        self._state = state

    def path(self, name: str, description: str) -> Path:
        if self._state.run_dir is None:
            raise RuntimeError("rlk_files.path: this run writes no artifacts")
        path = self._state.run_dir / rlk_session.FILES / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._state.writer is not None:
            self._state.writer.add_file(description, path)
        return path


@pytest.fixture(scope="session")
def rlk_files(request) -> RunFiles:
    """Files of the run as a whole: ``rlk_files.path("table.txt", "backend parity table")``."""
    return RunFiles(request.config.stash[STATE])


def _test_record(item, outcome: str, *, duration: float = 0.0, skip_reason: str | None = None,
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
    record = _test_record(item, "passed")
    settings = GateSettings(baselines=opts.baselines, platform=record.gated_platform(state.platform.tag),
                            update=opts.update_baselines, require=opts.require_baselines,
                            refresh_rel=opts.refresh_rel, fail_on_improvement=opts.fail_on_improvement)
    try:
        outcome = gate_test(record, settings, _provenance(state))
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
            state.writer.add(_record_from_phases(item, phases))
    return report


def _skip_reason(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module skipped at collection (``pytest.importorskip`` at its top) is one skip in
    pytest's count: the run records it too, so the summary's skips add up to pytest's."""
    report = yield
    state = collector.config.stash.get(STATE, None)
    if report.skipped and report.nodeid and state is not None and state.writer is not None:
        state.writer.add(TestRecord(
            nodeid=report.nodeid, case=case_from_nodeid(report.nodeid),
            tier=markers.tier_of(Path(report.nodeid), ()), outcome="skipped",
            skip_reason=_skip_reason(report), worker=state.worker or "main"))
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
        skip_reason = _skip_reason(next(r for r in phases.values() if r.skipped))
    else:
        outcome = "passed"
    return _test_record(item, outcome, duration=duration, skip_reason=skip_reason, failure=failure)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    state = config.stash.get(STATE, None)
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
    if state is None or state.run is None:
        return result
    run = state.run
    terminalreporter.section("rlk")
    for line in summary_lines(run, state.run_dir, state.opts.tiers, not_collected=state.not_collected):
        terminalreporter.write_line(line)
    for extra in config.hook.pytest_rlk_summary(config=config, run=run):
        for line in extra or ():
            terminalreporter.write_line(line)
    return result
