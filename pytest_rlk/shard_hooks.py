"""The hooks of ``--rlk-shard-gpus``: its controller pins one xdist worker per GPU, the workers
leave the multi-GPU tests to an all-GPU phase, which the controller runs once they are done
(the plain logic is ``pytest_rlk.sharding``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_rlk import sharding
from pytest_rlk.state import UNSERVED, RlkState


def configure_sharding(config, state: RlkState, workerinput: dict | None) -> None:
    """``--rlk-shard-gpus`` (its controller and workers) and the all-GPU phase that follows it."""
    opts = state.opts
    if opts.all_gpu_phase is None and not opts.shard_gpus:
        return
    try:
        if opts.all_gpu_phase is not None:
            state.worker, state.run_dir = sharding.ALL_GPU_WORKER, opts.all_gpu_phase
            hooks = AllGpuPhaseHooks(sharding.read_nodeids(opts.all_gpu_phase))
        elif workerinput is not None:
            sharding.check_worker(workerinput, os.environ, config.inipath)
            hooks = ShardWorkerHooks(shared_gpus=opts.workers_per_gpu > 1)
        else:
            sharding.check_xdist(config.pluginmanager.hasplugin("xdist"))
            config.option.tx, state.gpu_shards = sharding.pin_workers(
                config.option.tx, state.platform, os.environ, config.invocation_params.args, opts.workers_per_gpu)
            hooks = ShardControllerHooks(state)
    except sharding.ShardError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.pluginmanager.register(hooks, "rlk-shard-gpus")


def _held_back(items: list, shared_gpus: bool) -> list:
    """Remove the tests that wait for the all-GPU phase from ``items``; returns them."""
    keep, held = sharding.split_held_back(
        items, lambda item: ([(m.name, m.args) for m in item.iter_markers()], UNSERVED in item.stash), shared_gpus)
    items[:] = keep
    return held


class ShardWorkerHooks:
    """An xdist worker pinned to one GPU: it leaves the multi-GPU tests to the all-GPU phase (and,
    where workers share the GPU, the tests that must have it to themselves)."""

    def __init__(self, shared_gpus: bool = False) -> None:
        self.shared_gpus = shared_gpus

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        config.workeroutput[sharding.WORKEROUTPUT_KEY] = [item.nodeid for item in _held_back(items, self.shared_gpus)]

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item, nextitem):
        if self.shared_gpus:  # after the test's fixtures are gone: its tensors are free
            sharding.release_cached_gpu_memory()


class AllGpuPhaseHooks:
    """The all-GPU phase: only the tests the workers left to it."""

    def __init__(self, nodeids: list[str]) -> None:
        self.nodeids = set(nodeids)

    def pytest_ignore_collect(self, collection_path, config):
        root = Path(config.rootpath)
        if not collection_path.is_relative_to(root):
            return None
        rel = collection_path.relative_to(root).as_posix()
        return True if sharding.outside_phase(rel, collection_path.is_dir(), self.nodeids) else None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        drop = [item for item in items if item.nodeid not in self.nodeids]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [item for item in items if item.nodeid in self.nodeids]


class ShardControllerHooks:
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
