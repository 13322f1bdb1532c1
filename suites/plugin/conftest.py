"""Fixtures for the plugin's own tests: pytester runs that load pytest_rlk from this checkout."""
from __future__ import annotations

import os

import pytest
from rlk_plugin_testing import checkout_pythonpath


@pytest.fixture
def rlk_pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester whose runs (in-process and subprocess) load pytest_rlk from this checkout,
    whether or not the package is also pip-installed."""
    monkeypatch.setenv("PYTHONPATH", checkout_pythonpath(os.environ.get("PYTHONPATH")))
    monkeypatch.delenv("VIME_RL_KERNEL_BACKEND", raising=False)
    pytester.makeconftest('pytest_plugins = ["pytest_rlk.plugin"]\n')
    return pytester
