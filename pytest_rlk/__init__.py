"""pytest-rlk: a pytest plugin that records, gates and reports metrics of fused RL operators.

The plugin lives in :mod:`pytest_rlk.plugin`; the ``rlk`` command line in :mod:`pytest_rlk.cli`.
"""
from __future__ import annotations

__version__ = "0.1.0"
