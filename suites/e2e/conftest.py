"""Shared helpers for the e2e suite: paths of the stand-in and the line fixtures.

Without a GPU the kernels this suite calls in-process run through Triton's interpreter, which must
be on before ``kernels.ops`` is first imported (as in the op and module tiers' conftests), whichever
subset of tests runs.
"""

from __future__ import annotations

import importlib.util
import os
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
