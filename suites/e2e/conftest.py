"""Shared helpers for the e2e suite: paths of the stand-in and the line fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

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
