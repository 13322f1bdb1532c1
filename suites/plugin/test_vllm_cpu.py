"""The AMX request a process makes before vLLM's CPU attention runs in it."""
from __future__ import annotations

import pytest

from pytest_rlk import vllm_cpu

torch = pytest.importorskip("torch")


def test_this_process_may_run_amx_where_the_cpu_has_it():
    assert vllm_cpu.allow_amx() is None  # granted, or a CPU without AMX: nothing to ask


def test_a_refused_request_says_why(monkeypatch):
    # STAND-IN for a kernel that refuses the request (a container that masks the feature)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    assert "refused its use (arch_prctl)" in vllm_cpu.allow_amx()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert vllm_cpu.allow_amx() is None
