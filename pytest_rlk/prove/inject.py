"""A pytest plugin that puts a fault behind ``rlk-triton`` for one run (``rlk prove`` loads it):

    pytest -p pytest_rlk.prove.inject --rlk-inject-fault logp_bias=1e-3 <tests>

The tests run unchanged and ask for ``rlk-triton`` as always; the kernels' registry hands them
``pytest_rlk.prove.faults.FaultyTritonBackend`` instead (``kernels.backends.register_backend``
replaces a name). ``RLK_FAULT`` is set for the run, so a process it spawns that loads
``pytest_rlk.prove.faults:make_backend`` by dotted path gets the same fault.
"""
from __future__ import annotations

import os

import pytest

OPTION = "--rlk-inject-fault"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("rlk").addoption(
        OPTION, metavar="NAME=SIZE", default=None,
        help="serve rlk-triton with this fault (pytest_rlk.prove.faults.WRAPPERS); for rlk prove")


def pytest_configure(config: pytest.Config) -> None:
    text = config.getoption("rlk_inject_fault")
    if not text:
        return
    from pytest_rlk.prove.faults import FAULT_ENV, parse_fault

    try:
        name, size = parse_fault(text)
    except ValueError as exc:
        raise pytest.UsageError(f"{OPTION}: {exc}") from None
    os.environ[FAULT_ENV] = text

    def factory():
        from pytest_rlk.prove.faults import faulty_backend

        return faulty_backend(name, size)

    from kernels.backends import register_backend

    register_backend("rlk-triton", factory)
