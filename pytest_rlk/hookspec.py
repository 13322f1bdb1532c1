"""Hooks that other plugins (or a conftest) implement to extend pytest-rlk."""
from __future__ import annotations

import pytest


@pytest.hookspec(firstresult=True)
def pytest_rlk_platform(config):
    """Return a :class:`pytest_rlk.schema.PlatformInfo` to replace hardware detection, or None."""


def pytest_rlk_summary(config, run):
    """Called with the merged :class:`pytest_rlk.schema.RunRecord` at the end of the run
    (controller only); return a list of extra lines for the ``rlk`` terminal section."""
