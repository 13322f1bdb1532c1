"""Helpers for the plugin's own tests (a plain module: test files import it by name)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pytest_rlk import storage
from pytest_rlk.e2e.processes import pythonpath_first
from pytest_rlk.schema import RunRecord

REPO_ROOT = Path(__file__).resolve().parents[2]


def checkout_pythonpath(existing: str | None) -> str:
    """The checkout first, then whatever PYTHONPATH held: on the GPU machines pydantic & co live
    in /tmp/site through PYTHONPATH, so replacing it breaks every subprocess there."""
    return pythonpath_first(REPO_ROOT, environ={"PYTHONPATH": existing or ""})


def latest_run(pytester: pytest.Pytester) -> RunRecord:
    run_file = storage.resolve_run_file("latest", pytester.path / ".rlk" / "runs")
    return storage.load_run(run_file)


def latest_run_dir(pytester: pytest.Pytester) -> Path:
    return storage.resolve_run_dir("latest", pytester.path / ".rlk" / "runs")
