"""Fixtures of the vime conformance suite (marker ``vime``; the fork's provider: ``vime_fork``).

``--rlk-vime-root`` names an upstream vime checkout (or a tree rebuilt from its files at a pinned
commit), ``--rlk-vime-fork-root`` a checkout of the RL-Align fork. Without them every test here skips
with the reason (the ``vime`` marker's check in pytest_rlk/markers.py; ``vime_fork`` below).

vime's ``torch.compile``-decorated helpers (``compute_policy_loss``, ``compute_approx_kl``,
``compute_cispo_loss``) run eagerly here (``TORCHDYNAMO_DISABLE=1`` unless the caller set it):
inductor compiles a C++ kernel per dynamic shape, minutes on a 2-core CPU, for the same math.
Nothing of vime is stubbed: a module that cannot be imported is an error naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from suites.module.vime import conformance  # noqa: E402


def _root(config, option: str) -> Path | None:
    value = config.getoption(option)
    if value is None:
        return None
    path = Path(value).expanduser().resolve()
    if not path.is_dir():
        raise pytest.UsageError(f"--{option.replace('_', '-')}: {value!r} is not a directory")
    return path


def pytest_collection_modifyitems(config, items):
    fork_root = _root(config, "rlk_vime_fork_root")
    for item in items:
        if item.get_closest_marker("vime_fork") is not None and fork_root is None:
            item.add_marker(pytest.mark.skip(reason="needs the RL-Align vime fork (--rlk-vime-fork-root not given)"))


@pytest.fixture(scope="session")
def vime_root(request) -> Path:
    root = _root(request.config, "rlk_vime_root")
    assert root is not None, "the vime marker guarantees --rlk-vime-root"
    return root


@pytest.fixture(scope="session")
def vime_fork_root(request) -> Path:
    root = _root(request.config, "rlk_vime_fork_root")
    assert root is not None, "the vime_fork marker guarantees --rlk-vime-fork-root"
    return root


@pytest.fixture(scope="session")
def megatron_single_rank():
    conformance.init_single_rank_megatron()


@pytest.fixture
def vime_loss(vime_root, megatron_single_rank):
    """vime's own ``vime.backends.megatron_utils.loss`` from the upstream root."""
    return conformance.use_vime_root(vime_root, conformance.LOSS_MODULE)


@pytest.fixture
def reference_arm(monkeypatch):
    """Our adapter on its fp32 reference backend, no strict mode (fallbacks must be visible, not raised)."""
    import kernels
    from kernels.integrations import vime as adapter

    monkeypatch.setenv("VIME_RL_KERNEL", "0")
    monkeypatch.delenv("VIME_RL_KERNEL_STRICT", raising=False)
    monkeypatch.delenv(adapter.NATIVE_LOSS_ENV, raising=False)
    kernels.reset_fallback_counts()
    adapter.reset_init_decision()
    yield
    kernels.reset_fallback_counts()
    adapter.reset_init_decision()
