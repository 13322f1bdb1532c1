"""Helpers for the plugin's own tests (a plain module: test files import it by name)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pytest_rlk import storage
from pytest_rlk.e2e.processes import pythonpath_first
from pytest_rlk.schema import RunRecord

REPO_ROOT = Path(__file__).resolve().parents[2]


def machine_conftest(**platform: object) -> str:
    """A conftest whose ``pytest_rlk_platform`` hook reports the machine ``PlatformInfo(**platform)``
    whatever this host has, so a test of what a machine serves holds on every host."""
    fields = ", ".join(f"{name}={value!r}" for name, value in platform.items())
    return ('pytest_plugins = ["pytest_rlk.plugin"]\nfrom pytest_rlk.schema import PlatformInfo\n\n'
            f"def pytest_rlk_platform(config):\n    return PlatformInfo({fields})\n")


def host_gpu_count() -> int:
    """The GPUs torch sees on this host (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# RLK_FAKE_GPUS gives the sharding fake device ids on a machine without GPUs and is refused where
# GPUs exist (pytest_rlk/sharding.py); its refusal there is tested on every host.
needs_gpuless_host = pytest.mark.skipif(
    host_gpu_count() > 0,
    reason="the RLK_FAKE_GPUS seam is for machines without GPUs and this host has one; the real "
           "sharding runs here with -n auto --rlk-shard-gpus")


def checkout_pythonpath(existing: str | None) -> str:
    """The checkout first, then whatever PYTHONPATH held: on the GPU machines pydantic & co live
    in /tmp/site through PYTHONPATH, so replacing it breaks every subprocess there."""
    return pythonpath_first(REPO_ROOT, environ={"PYTHONPATH": existing or ""})


def latest_run(pytester: pytest.Pytester) -> RunRecord:
    run_file = storage.resolve_run_file("latest", pytester.path / ".rlk" / "runs")
    return storage.load_run(run_file)


def latest_run_dir(pytester: pytest.Pytester) -> Path:
    return storage.resolve_run_dir("latest", pytester.path / ".rlk" / "runs")
