"""Shared helpers for the e2e suite: paths of the stand-in and the line fixtures.

Without a GPU the kernels this suite calls in-process run through Triton's interpreter, which must
be on before ``kernels.ops`` is first imported (as in the op and module tiers' conftests), whichever
subset of tests runs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("torch") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
STANDIN = HERE / "standin_vime_train.py"


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture
def standin() -> Path:
    """The stand-in for vime's train.py (used only because vime cannot run here)."""
    return STANDIN


@pytest.fixture(scope="session")
def cpu_kernels_reason() -> str | None:
    """Why our kernels cannot run on CPU tensors here, or None: asked in a fresh process with
    Triton's interpreter on, as a CPU lane's arm runs them (kernels/backends/triton.py's probe; on
    the GPU machines' image its Triton and numpy disagree)."""
    from pytest_rlk.e2e.processes import pythonpath_first

    root = HERE.parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath_first(root))
    proc = subprocess.run([sys.executable, "-c", "from kernels.backends.triton import interpreter_fails\n"
                           "print(interpreter_fails() or '')"], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300, check=False)
    if proc.returncode != 0:
        return f"the interpreter probe's process failed: {proc.stderr.strip()[-500:]}"
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else None
