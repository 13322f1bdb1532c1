"""One pytest-xdist worker per GPU of a node (``--rlk-shard-gpus``), plain functions.

``pytest -n auto --rlk-shard-gpus`` (or ``-n N``, N <= the node's GPUs) starts worker ``gw<i>``
with ``CUDA_VISIBLE_DEVICES`` set to the node's i-th GPU. The variable is set by execnet in the
new worker process before pytest starts in it (an ``env:`` entry of the worker's ``--tx`` spec),
so it is in place before anything in that process can initialise CUDA; the worker checks it at
configure time. Each worker runs one test at a time, so a test has its GPU to itself:
benchmarks never share a GPU with another test while they time.

Tests marked ``gpus(n)`` with n > 1 are not run by the workers. After the workers are done, the
controller runs them in an *all-GPU phase*: one serial pytest (same arguments, ``-n 0``) with
every GPU of the node visible, alone on the node, writing its part file
(``parts/all-gpus.json``) into the same run directory. The run file then holds both phases.

``--rlk-workers-per-gpu K`` (K > 1) lets K workers share each GPU: the op and module tiers spend
most of a night compiling kernels and building models on the host, which K processes do side by
side. What times or measures the whole GPU (``bench`` tests, tests marked ``exclusive_gpu``) or
asks for much of its memory (``gpu_mem(gb)``) then waits for the all-GPU phase too, so it still has
the node to itself.

Test seam: on a machine without GPUs, ``RLK_FAKE_GPUS=N`` (``kernels/settings.py`` FAKE_GPUS)
makes the sharding see N GPUs with ids 0..N-1 (workers get ``CUDA_VISIBLE_DEVICES=0``, ``1``, ...)
without changing the platform, so the CPU forms of the tests run exactly as they would serially.
It is refused where GPUs exist.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from pytest_rlk import storage
from pytest_rlk._kernels_guard import import_project_settings
from pytest_rlk.schema import PlatformInfo
from pytest_rlk.session import ALL_GPU_WORKER, PARTS

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
NODEIDS_FILE = "all-gpu-nodeids.txt"  # in the run dir: what the all-GPU phase runs
WORKEROUTPUT_KEY = "rlk_all_gpu_nodeids"
_GPU_KEY, _INIPATH_KEY = "rlk_gpu", "rlk_inipath"  # what the controller tells each worker
T = TypeVar("T")


class ShardError(ValueError):
    """Sharding cannot work as asked; the plugin turns it into a pytest usage error."""


def fake_gpu_count() -> int | None:
    """``RLK_FAKE_GPUS`` (None: unset); a bad value is a :class:`ShardError` naming it."""
    try:
        return import_project_settings().FAKE_GPUS.get()
    except ValueError as exc:
        raise ShardError(str(exc)) from None


def node_gpu_ids(platform: PlatformInfo, env: Mapping[str, str], fake: int | None = None) -> list[str]:
    """The node's GPUs as ``CUDA_VISIBLE_DEVICES`` entries, in torch's device order (``fake``:
    the ``RLK_FAKE_GPUS`` count).

    Where this process already sees a subset (``CUDA_VISIBLE_DEVICES=2,3``), torch's device i is
    the i-th entry of that list, so worker i gets that entry, not ``i``.
    """
    if fake is not None:
        if platform.device_count:
            raise ShardError(f"RLK_FAKE_GPUS={fake}: a test seam for machines without GPUs; this one "
                             f"has {platform.describe()} (unset RLK_FAKE_GPUS)")
        return [str(i) for i in range(fake)]
    count = platform.device_count
    visible = [e.strip() for e in env.get(VISIBLE_ENV, "").split(",") if e.strip()]
    if not visible:
        return [str(i) for i in range(count)]
    if len(visible) < count:
        raise ShardError(f"{VISIBLE_ENV}={env[VISIBLE_ENV]!r} lists {len(visible)} devices but torch "
                         f"sees {count}")
    return visible[:count]


def worker_tx_specs(tx: Sequence[str], gpu_ids: Sequence[str], per_gpu: int = 1) -> list[str]:
    """xdist's ``--tx`` specs for ``-n N`` (N times ``popen``), each pinned to one GPU: worker i
    to GPU ``i % len(gpu_ids)``, at most ``per_gpu`` workers on each."""
    if not tx:
        raise ShardError("--rlk-shard-gpus runs one pytest-xdist worker per GPU: add -n auto (one per "
                         "GPU) or -n N")
    if any(spec != "popen" for spec in tx):
        raise ShardError(f"--rlk-shard-gpus makes the workers' --tx specs itself; got --tx {list(tx)}: "
                         "use -n N instead")
    if not gpu_ids:
        raise ShardError("--rlk-shard-gpus: this machine has no GPU to shard over (a CPU machine can "
                         "set RLK_FAKE_GPUS=N to test the sharding)")
    if len(tx) > per_gpu * len(gpu_ids):
        if per_gpu == 1:
            raise ShardError(f"--rlk-shard-gpus: -n {len(tx)} workers for {len(gpu_ids)} GPUs; two workers "
                             "would share a GPU (and time their benchmarks against each other): use -n auto, "
                             "or --rlk-workers-per-gpu K to share each GPU between K workers")
        raise ShardError(f"--rlk-shard-gpus: -n {len(tx)} workers for {len(gpu_ids)} GPUs at "
                         f"--rlk-workers-per-gpu={per_gpu}: at most {per_gpu * len(gpu_ids)} (use -n auto)")
    # no id=: xdist numbers the workers gw0, gw1, ... in this order, and a crashed worker's
    # replacement (a new id, the same spec) keeps its GPU
    return [f"popen//env:{VISIBLE_ENV}={gpu_ids[i % len(gpu_ids)]}" for i in range(len(tx))]


def check_xdist(have_xdist: bool) -> None:
    if not have_xdist:
        raise ShardError("--rlk-shard-gpus needs pytest-xdist (one worker per GPU, -n auto)")


def pin_workers(tx: Sequence[str], platform: PlatformInfo, env: Mapping[str, str],
                invocation_args: Sequence[str], per_gpu: int = 1) -> tuple[list[str], dict[str, str]]:
    """The controller: the workers' ``--tx`` specs, one GPU each, and the shard map (worker id ->
    its GPUs) for the manifest."""
    check_path_options(invocation_args)
    gpu_ids = node_gpu_ids(platform, env, fake_gpu_count())
    specs = worker_tx_specs(tx, gpu_ids, per_gpu)
    return specs, shard_map(specs, gpu_ids)


def worker_input(spec_env: Mapping[str, str], controller_inipath: Path | None) -> dict[str, str]:
    """What the controller tells a worker so it can check itself: the GPU its spec pins it to
    (from the spec's ``env:`` entries) and the config file the controller read."""
    return {_GPU_KEY: spec_env[VISIBLE_ENV], _INIPATH_KEY: str(controller_inipath)}


def check_worker(workerinput: Mapping[str, object], env: Mapping[str, str], inipath: Path | None) -> None:
    """A worker: pinned as its spec said, reading the controller's config file."""
    check_worker_pinning(str(workerinput[_GPU_KEY]), env)
    check_worker_config(str(workerinput[_INIPATH_KEY]), inipath)


def shard_map(tx_specs: Sequence[str], gpu_ids: Sequence[str]) -> dict[str, str]:
    """worker id -> its ``CUDA_VISIBLE_DEVICES`` (the all-GPU phase: every GPU), for the manifest."""
    shards = {f"gw{i}": gpu_ids[i % len(gpu_ids)] for i in range(len(tx_specs))}
    shards[ALL_GPU_WORKER] = ",".join(gpu_ids)
    return shards


def check_worker_pinning(expected: str, env: Mapping[str, str]) -> None:
    """A worker's ``CUDA_VISIBLE_DEVICES`` must be the one its spec set (nothing overrode it)."""
    have = env.get(VISIBLE_ENV)
    if have != expected:
        raise ShardError(f"--rlk-shard-gpus: this worker should see GPU {expected} but "
                         f"{VISIBLE_ENV}={have!r}")


def check_path_options(invocation_args: Sequence[str]) -> None:
    """``--rlk-artifacts DIR`` (a separate value) breaks xdist's workers: pytest looks for its
    config file before it knows plugin options, takes ``DIR`` for a test path once it exists, and
    the controller has created it by the time the workers start; they then find no config file
    and collect other tests. ``--rlk-artifacts=DIR`` is one token and safe."""
    if "--rlk-artifacts" in invocation_args:
        raise ShardError("--rlk-shard-gpus: give --rlk-artifacts=DIR with '=' (as a separate value, DIR "
                         "would be taken for a test path by the xdist workers, which then miss the config "
                         "file and collect other tests)")


def check_worker_config(controller_inipath: str, worker_inipath: Path | None) -> None:
    """A worker must read the controller's config file: one that finds none collects with
    pytest's defaults (e.g. without ``bench_*.py``) and would silently run fewer tests (see
    :func:`check_path_options`; this catches what that cannot foresee)."""
    if str(worker_inipath) != controller_inipath:
        raise ShardError(f"an xdist worker read the config file {worker_inipath} but the controller read "
                         f"{controller_inipath}; it would collect other tests. Give path options with '=' "
                         "(--rlk-artifacts=DIR, --rlk-baselines=DIR), or pass -c/--rootdir")


def gpus_needed(marks: Iterable[tuple[str, tuple]]) -> float:
    """The GPUs a test's ``gpus(n)`` markers ask for (1 without one)."""
    needed = [args[0] for name, args in marks if name == "gpus" and len(args) == 1
              and isinstance(args[0], (int, float))]
    return max(needed, default=1)


ALONE_MARKERS = ("bench", "exclusive_gpu", "gpu_mem")  # what times the GPU or needs its memory: not shared


def runs_in_all_gpu_phase(marks: Iterable[tuple[str, tuple]], *, unserved: bool, shared_gpus: bool = False) -> bool:
    """Tests needing more than one GPU wait for the all-GPU phase (unless they skip anyway); where
    workers share a GPU (``shared_gpus``), so do benchmarks and ``exclusive_gpu`` tests."""
    marks = list(marks)
    if unserved:
        return False
    return gpus_needed(marks) > 1 or (shared_gpus and any(name in ALONE_MARKERS for name, _ in marks))


# GPU memory per sharing worker: four workers on one 80 GB H100 ran the op and module tiers with no
# CUDA out-of-memory once each returns its cache after a test (docs/gpu-runs.md rows 165-166)
SHARED_WORKER_BYTES = 20 * 10**9


def nightly_workers_per_gpu(gpu_memory_bytes: int, cpu_count: int, gpu_count: int = 1) -> int:
    """How many xdist workers the GPU nightly lets share each GPU: one per ``SHARED_WORKER_BYTES``
    of the smallest GPU's memory (4 on an 80 GB H100, 7 on a 141 GB H200), at most one per two
    CPU cores of the node's share per GPU (the workers' time is host work: compiles, model builds)."""
    if gpu_memory_bytes <= 0 or cpu_count <= 0 or gpu_count <= 0:
        raise ValueError(f"nightly_workers_per_gpu({gpu_memory_bytes}, {cpu_count}, {gpu_count}): "
                         "expected a positive memory, CPU count and GPU count")
    by_memory = gpu_memory_bytes // SHARED_WORKER_BYTES
    by_cores = cpu_count // (2 * gpu_count)
    return max(1, min(by_memory, by_cores))


def release_cached_gpu_memory() -> bool:
    """Return torch's cached GPU blocks to the driver (True where it did). Where workers share a
    GPU, the blocks one worker's test leaves in its caching allocator are memory the other workers'
    tests cannot have (four workers on one 80 GB H100 hold most of it cached otherwise). Torch is
    never imported here; a worker that has not used CUDA has nothing to return."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return False
    cuda.empty_cache()
    return True


def split_held_back(items: Sequence[T], marks_and_unserved: Callable[[T], tuple[list, bool]],
                    shared_gpus: bool = False) -> tuple[list[T], list[T]]:
    """``items`` as (run by this worker, held back for the all-GPU phase); ``marks_and_unserved``
    gives an item's ``(marker name, args)`` pairs and whether it skips anyway."""
    keep, held = [], []
    for item in items:
        marks, unserved = marks_and_unserved(item)
        (held if runs_in_all_gpu_phase(marks, unserved=unserved, shared_gpus=shared_gpus) else keep).append(item)
    return keep, held


def write_nodeids(run_dir: Path, nodeids: Sequence[str]) -> Path:
    path = run_dir / NODEIDS_FILE
    storage.write_json_atomic(path, "\n".join(nodeids))
    return path


def read_nodeids(run_dir: Path) -> list[str]:
    path = run_dir / NODEIDS_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ShardError(f"--rlk-all-gpu-phase: {path} does not exist (this option is set by the "
                         "controller of a --rlk-shard-gpus run, not by hand)") from None
    return [line for line in text.splitlines() if line.strip()]


def outside_phase(rel_path: str, is_dir: bool, nodeids: Iterable[str]) -> bool:
    """Whether the all-GPU phase may leave ``rel_path`` (relative to the rootdir, ``/``-separated)
    uncollected: a test file that holds none of its ``nodeids``, or a folder that holds none of
    their files. Its pytest would otherwise import every test module of the tiers (torch,
    transformers, our kernels) to run the few dozen tests the workers left it. Packages'
    ``__init__.py`` and conftests are never left out."""
    files = {nodeid.split("::", 1)[0] for nodeid in nodeids}
    rel = rel_path.strip("/")
    if not rel or rel == ".":
        return False
    if is_dir:
        return not any(f.startswith(rel + "/") for f in files)
    name = rel.rsplit("/", 1)[-1]
    return name.endswith(".py") and name not in ("__init__.py", "conftest.py") and rel not in files


def all_gpu_phase_argv(invocation_args: Sequence[str], run_dir: Path) -> list[str]:
    """The serial pytest of the all-GPU phase: the same arguments, no xdist, joined to the run.
    (The options given last win, so the user's ``-n``/``--dist`` are overridden.)"""
    return [sys.executable, "-m", "pytest", *invocation_args, "-n", "0", "--dist=no",
            f"--rlk-all-gpu-phase={run_dir}"]


def all_gpu_phase_env(env: Mapping[str, str]) -> dict[str, str]:
    """The controller's environment (it sees every GPU) without xdist's worker variables (the
    phase is no xdist worker, even when this whole run is nested in one)."""
    return {k: v for k, v in env.items() if not k.startswith("PYTEST_XDIST_")}


def phase_outcomes(run_dir: Path) -> Counter[str] | None:
    """Outcomes the all-GPU phase recorded (None: it wrote no part file)."""
    path = run_dir / PARTS / f"{ALL_GPU_WORKER}.json"
    if not path.exists():
        return None
    return Counter(t.outcome for t in storage.load_part(path).tests)


def run_all_gpu_phase(nodeids: Sequence[str], run_dir: Path, *, invocation_args: Sequence[str], cwd: Path,
                      gpus: str, say: Callable[..., None]) -> int:
    """The held-back tests in one serial pytest that sees every GPU, in the foreground (its output
    is the run's; a Ctrl-C reaches it with the controller); returns its failures (1 where pytest
    itself failed). ``say(line, red=...)`` writes to the terminal."""
    write_nodeids(run_dir, nodeids)
    argv = all_gpu_phase_argv(invocation_args, run_dir)
    count = ("1 test that needs more than one GPU or a GPU to itself" if len(nodeids) == 1 else
             f"{len(nodeids)} tests that need more than one GPU or a GPU to themselves")
    say("")
    say(f"rlk: all-GPU phase: {count}, alone on the node with GPUs {gpus} visible")
    status = subprocess.run(argv, cwd=cwd, check=False, env=all_gpu_phase_env(os.environ)).returncode
    outcomes = phase_outcomes(run_dir)
    if outcomes is None or status not in (0, 1):
        say(f"rlk: all-GPU phase: pytest exited with status {status}"
            + ("" if outcomes else " and recorded no test") + f": {shlex.join(argv)}", red=True)
        return 1
    say("rlk: all-GPU phase: " + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())))
    return outcomes["failed"] + outcomes["error"]
