"""Fixtures of the tests of the ops as PyTorch operators: every test refuses to run with torch.compile
disabled; ``backend`` runs a test on the reference (every switch cleared) and on rlk-triton (strict);
``rlk_triton`` sets rlk-triton alone. Each checks that no call fell back."""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from suites.op.torch_library.cases import BACKENDS, KERNELS_ON, SWITCHES


@pytest.fixture(autouse=True)
def dynamo_enabled():
    """torch.compile is a no-op under TORCHDYNAMO_DISABLE=1: the compile tests would pass vacuously."""
    if os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        pytest.fail("TORCHDYNAMO_DISABLE=1 in this process: torch.compile does nothing, so these tests prove nothing")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Every switch cleared (the default: the reference), or the kernels on, strict."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    if request.param == "rlk-triton":
        for name, value in KERNELS_ON.items():
            monkeypatch.setenv(name, value)
    kernels.reset_fallback_counts()
    yield request.param
    assert kernels.fallback_counts() == {}
    torch._dynamo.reset()


@pytest.fixture
def rlk_triton(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for name, value in KERNELS_ON.items():
        monkeypatch.setenv(name, value)
    kernels.reset_fallback_counts()
    yield
    assert kernels.fallback_counts() == {}
    torch._dynamo.reset()
