"""Fixture of kernels.launch's tests: ``stand_ins`` installs a stand-in runtime and a recording
stand-in for Triton's launch behind a fresh CachedLaunch; it returns (the launch, the stand-in
``kernel[grid]``, the runtime)."""

from __future__ import annotations

import pytest

from kernels import launch
from suites.op.launch.stand_ins import Normal, Runtime, jit


@pytest.fixture
def stand_ins(monkeypatch):
    runtime = Runtime()
    monkeypatch.setattr(launch, "_runtime", runtime)
    monkeypatch.setattr(launch, "_disabled", None)
    fast = jit()
    normal = Normal()
    fast.kernel = normal
    return fast, normal, runtime
