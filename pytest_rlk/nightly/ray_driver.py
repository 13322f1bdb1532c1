"""``rlk nightly PLAN``: one pytest job per node of the plan, through Ray.

Each node job is a Ray task (a streaming generator, ``max_retries=0``) that asks for its node
kind's custom resources (``{"h100": 1}``), so Ray places it on such a node; nothing here
schedules. The task runs :func:`pytest_rlk.nightly.node_job.run_node_job` there and yields the
run's new files every ``sync_interval_s``; the driver unpacks them under
``<nightly dir>/nodes/<node>/`` as they arrive, so a node that dies keeps what it sent. Node
outcomes go to ``nightly.json`` as they happen; ``rlk verdict <nightly dir>`` (run at the end)
turns everything into one verdict.

The suite reaches the nodes as the plan says: ``suite_root`` (the same checkout on every node)
or, by default, this checkout shipped through Ray's ``runtime_env`` ``working_dir`` (the commit
is passed on as ``RLK_SUITE_COMMIT``, since the shipped copy has no ``.git``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pytest_rlk import storage
from pytest_rlk.manifest import SUITE_COMMIT_ENV, suite_state, utc_now
from pytest_rlk.nightly.node_job import NodeJob, run_node_job, unpack_files
from pytest_rlk.nightly.plan import NIGHTLY_FILE, NightlyPlan, NightlyRecord, NodeOutcome, NodeSpec
from pytest_rlk.options import OptionError
from pytest_rlk.session import merge_run

NODES = "nodes"
NODE_FILE = "node.json"
# never shipped to the nodes: run artifacts, git, local trees and caches
SHIP_EXCLUDES = [".git", ".rlk", ".vime", ".tox", ".whl", "*.egg-info", "__pycache__", ".pytest_cache"]
# beyond the node's own timeout and stop sequence: how long the driver waits before giving up
ANSWER_SLACK_S = 120.0


class NoCluster(OptionError):
    """No Ray cluster answers at the address given (a usage error: nothing ran)."""


def node_task(job: NodeJob) -> Iterator[dict]:
    """The body of a node's Ray task."""
    yield from run_node_job(job)


@dataclass
class _Pending:
    spec: NodeSpec
    gen: object  # ray.ObjectRefGenerator
    submitted: float
    started: float | None = None
    last_message: float = 0.0
    tests_reported: int = 0


def runtime_env(plan: NightlyPlan, suite_root: Path) -> dict:
    """The Ray job's runtime environment: how the node jobs find the suite."""
    if plan.suite_root is not None:
        # the task itself imports pytest_rlk from the nodes' checkout
        return {"env_vars": {"PYTHONPATH": f"{plan.suite_root}:${{PYTHONPATH}}"}}
    commit = suite_state(suite_root)[0]
    env = {"working_dir": str(suite_root), "excludes": SHIP_EXCLUDES}
    if commit:
        env["env_vars"] = {SUITE_COMMIT_ENV: commit}
    return env


def _job(plan: NightlyPlan, spec: NodeSpec) -> NodeJob:
    return NodeJob(name=spec.name, pytest_args=spec.pytest_argv(), suite_root=plan.suite_root, env=dict(spec.env),
                   timeout_s=spec.timeout_s, sync_interval_s=plan.sync_interval_s, stop_grace_s=plan.stop_grace_s)


class NightlyRunner:
    """Submits the plan's node jobs and records what each one did under ``nightly_dir``."""

    def __init__(self, plan: NightlyPlan, nightly_dir: Path, *, suite_root: Path,
                 say: Callable[[str], None] = print) -> None:
        self.plan = plan
        self.dir = nightly_dir
        self.suite_root = suite_root
        self.say = say
        self.record = NightlyRecord(plan=plan, started_utc=utc_now())
        self.pending: dict[str, _Pending] = {}

    def node_dir(self, name: str) -> Path:
        return self.dir / NODES / name

    def _save(self) -> None:
        storage.write_json_atomic(self.dir / NIGHTLY_FILE, self.record)

    def _finish(self, spec: NodeSpec, status: str, detail: str = "", *, exit_status: int | None = None,
                run_dir: str | None = None, host: str | None = None) -> None:
        self.pending.pop(spec.name, None)
        node_dir = self.node_dir(spec.name)
        run_path = node_dir / run_dir if run_dir else _newest_run(node_dir)
        if run_path is not None and (run_path / storage.RUN_FILE).exists():
            # a run whose pytest never finished it (the node died) is crashed; merge_run alone
            # could not tell where the controller lived on this host
            running = storage.load_run(run_path / storage.RUN_FILE).status == "running"
            merge_run(run_path, status="crashed" if running and status != "completed" else None)
        previous = self.record.nodes.get(spec.name)
        outcome = NodeOutcome(
            name=spec.name, platform=spec.platform, status=status, detail=detail, exit_status=exit_status,
            host=host or (previous.host if previous else None),
            run_dir=run_path.relative_to(self.dir).as_posix() if run_path is not None else None,
            started_utc=previous.started_utc if previous else None, finished_utc=utc_now())
        self.record.nodes[spec.name] = outcome
        storage.write_json_atomic(node_dir / NODE_FILE, outcome)
        self._save()
        kept = f"; run {outcome.run_dir}" if outcome.run_dir else ""
        self.say(f"nightly: {spec.name}: {status}{': ' + detail if detail else ''}{kept}")

    def _message(self, p: _Pending, message: dict) -> None:
        spec = p.spec
        p.last_message = time.monotonic()
        kind = message["kind"]
        if kind == "started":
            p.started = p.last_message
            self.record.nodes[spec.name] = NodeOutcome(
                name=spec.name, platform=spec.platform, status="no_answer", detail="running",
                host=message["host"], started_utc=message["utc"])
            self._save()
            self.say(f"nightly: {spec.name}: started on {message['host']}: {' '.join(message['argv'][1:])}")
        elif kind == "files":
            unpack_files(message["tar"], self.node_dir(spec.name))
            run_dir = _newest_run(self.node_dir(spec.name))
            count = _tests_so_far(run_dir) if run_dir is not None else 0
            if count != p.tests_reported:
                p.tests_reported = count
                self.say(f"nightly: {spec.name}: {count} tests recorded")
        elif kind == "not_started":
            self._finish(spec, "not_started", message["detail"])
        elif kind == "finished":
            if message["timed_out"]:
                self._finish(spec, "timed_out", f"stopped after timeout_s={spec.timeout_s:g}",
                             exit_status=message["exit_status"], run_dir=message["run_dir"])
            else:
                self._finish(spec, "completed", f"pytest exit status {message['exit_status']}",
                             exit_status=message["exit_status"], run_dir=message["run_dir"])

    def submit(self) -> None:
        import ray

        available = ray.cluster_resources()
        remote = ray.remote(num_cpus=0, max_retries=0)(node_task)
        self._save()
        for spec in self.plan.nodes:
            missing = {k: v for k, v in spec.resources.items() if available.get(k, 0) < v}
            if missing:
                self._finish(spec, "unschedulable", f"no node of the cluster has {missing} "
                                                    f"(the cluster has {_custom(available)})")
                continue
            gen = remote.options(resources=dict(spec.resources)).remote(_job(self.plan, spec))
            self.pending[spec.name] = _Pending(spec, gen, submitted=time.monotonic())
            self.say(f"nightly: {spec.name}: submitted, resources {spec.resources}")

    def wait(self, poll_s: float = 1.0) -> NightlyRecord:
        import ray
        from ray.exceptions import RayError

        while self.pending:
            by_gen = {id(p.gen): p for p in self.pending.values()}
            ready, _ = ray.wait([p.gen for p in self.pending.values()], num_returns=1, timeout=poll_s)
            for gen in ready:
                p = by_gen[id(gen)]
                try:
                    message = ray.get(next(gen))
                except StopIteration:
                    if p.spec.name in self.pending:
                        self._finish(p.spec, "died", "the node job ended without a final message")
                    continue
                except RayError as exc:
                    self._finish(p.spec, "died", f"{type(exc).__name__}: {_first_line(exc)}")
                    continue
                self._message(p, message)
            self._check_deadlines(ray)
        self.record.finished_utc = utc_now()
        self._save()
        return self.record

    def _check_deadlines(self, ray) -> None:
        now = time.monotonic()
        for p in list(self.pending.values()):
            if p.started is None and now - p.submitted > self.plan.schedule_timeout_s:
                detail = f"did not start within schedule_timeout_s={self.plan.schedule_timeout_s:g} (all such nodes busy?)"
            elif p.started is not None and now - p.started > (p.spec.timeout_s + self.plan.stop_grace_s
                                                              + self.plan.sync_interval_s + ANSWER_SLACK_S):
                detail = f"no final answer {now - p.last_message:.0f}s after its last message"
            else:
                continue
            ray.cancel(p.gen, force=True)
            self._finish(p.spec, "no_answer", detail)


def _custom(resources: dict[str, float]) -> str:
    names = {k: v for k, v in sorted(resources.items())
             if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:")}
    return str(names or "no custom resources")


def _newest_run(node_dir: Path) -> Path | None:
    runs = sorted((node_dir / "runs").glob(f"*/{storage.RUN_FILE}"))
    return runs[-1].parent if runs else None


def _tests_so_far(run_dir: Path) -> int:
    count = 0
    for part in (run_dir / "parts").glob("*.json"):
        try:
            count += len(storage.load_part(part).tests)
        except storage.RlkFileError:
            pass
    return count


def _first_line(exc: BaseException) -> str:
    """Ray's messages run long: their first sentence."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return (line.split(". ", 1)[0] if len(line) > 160 else line).rstrip(".")


def run_nightly(plan: NightlyPlan, nightly_dir: Path, *, suite_root: Path, address: str | None = None,
                say: Callable[[str], None] = print) -> NightlyRecord:
    """Connect to the Ray cluster at ``address``, run every node job, disconnect, and return the
    record (also in ``nightly_dir/nightly.json``)."""
    import ray

    if ray.is_initialized():
        raise RuntimeError("run_nightly connects to Ray itself (the suite reaches the nodes through the "
                           "job's runtime_env): call it before ray.init, with the cluster's address")
    try:
        ray.init(address=address, logging_level="ERROR", runtime_env=runtime_env(plan, suite_root))
    except ConnectionError as exc:
        raise NoCluster(f"no Ray cluster at address {address!r} ({_first_line(exc)}). Start one "
                        "(`ray start --head` on one machine, `ray start --address=HEAD:6379 "
                        "--resources='{\"h100\": 1}'` on each node of a kind) and give its address "
                        "(--address or RAY_ADDRESS)") from None
    nightly_dir.mkdir(parents=True, exist_ok=True)
    runner = NightlyRunner(plan, nightly_dir, suite_root=suite_root, say=say)
    try:
        runner.record.address = ray.get_runtime_context().gcs_address
        runner.submit()
        return runner.wait()
    finally:
        for p in list(runner.pending.values()):  # interrupted: leave nothing running on the nodes
            ray.cancel(p.gen, force=True)
        ray.shutdown()
