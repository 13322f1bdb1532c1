"""Fixtures for the plugin's own tests: pytester runs that load pytest_rlk from this checkout."""
from __future__ import annotations

import os

import pytest
from rlk_plugin_testing import checkout_pythonpath


CALLER_PREFIXES = ("RLK_", "VIME_RL_KERNEL")
CALLER_NAMES = ("CUDA_VISIBLE_DEVICES",)


@pytest.fixture(autouse=True)
def _callers_settings_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's tests never read the caller's settings: a GPU nightly sets RLK_SUITE_COMMIT,
    a sharded worker CUDA_VISIBLE_DEVICES, a user VIME_RL_KERNEL*; each test starts without them
    and sets what it tests."""
    for name in list(os.environ):
        if name.startswith(CALLER_PREFIXES) or name in CALLER_NAMES:
            monkeypatch.delenv(name)


@pytest.fixture
def rlk_pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester whose runs (in-process and subprocess) load pytest_rlk from this checkout,
    whether or not the package is also pip-installed."""
    monkeypatch.setenv("PYTHONPATH", checkout_pythonpath(os.environ.get("PYTHONPATH")))
    monkeypatch.delenv("VIME_RL_KERNEL_BACKEND", raising=False)
    pytester.makeconftest('pytest_plugins = ["pytest_rlk.plugin"]\n')
    return pytester
