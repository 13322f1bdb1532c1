"""Op tier setup.

Without a CUDA device the Triton kernels run through Triton's interpreter, which must be switched
on before ``kernels.ops`` is first imported in this process (``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel is decorated). This conftest sets it at import, before any test
module of this directory imports ``kernels.ops``; spawned worker processes (TP tests) inherit it.
On a GPU machine nothing is set: the kernels compile.
"""

from __future__ import annotations

import os

import pytest

# Without torch this tier cannot run at all: skip its directory with the reason (shown by -rs and
# in the rlk summary) rather than erroring at import; a torch that is installed but broken still
# errors (only ModuleNotFoundError is caught).
torch = pytest.importorskip(
    "torch", reason="this tier needs torch: install the CPU stack (`tox -e tests`) or torch itself",
    exc_type=ModuleNotFoundError)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_device_report_left_over():
    """A report an earlier test's kernel left in an error word (kernels/device_errors.py) is
    cleared first: each test sees only its own calls' reports; so is the last gradient (word 3) an
    earlier test's grpo_loss backward left: each test's first one-read forward predicts a gradient
    of 1, as a fresh process's does."""
    from kernels import device_errors

    for word in list(device_errors._words.values()):
        if word.device.type == "cuda":
            torch.cuda.synchronize(word.device)
        word.take()
        word.view[device_errors.LAST_GRAD] = 0


@pytest.fixture
def triton_strict(monkeypatch):
    """Kernels on, rlk-triton backend, strict: a parity test can never compare reference to reference."""
    import kernels

    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_OPS", "*")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "rlk-triton")
    kernels.reset_fallback_counts()
    yield
    assert kernels.fallback_counts() == {}, "a parity test fell back to the reference"
    kernels.reset_fallback_counts()


@pytest.fixture
def user_default(monkeypatch):
    """What a user of the kernels runs: ``VIME_RL_KERNEL=1`` and nothing else (every other kernel
    setting at its default). The benchmarks time the public API this way."""
    from kernels import settings

    for setting in settings.SETTINGS.values():
        if setting.group == "kernels" and setting.name != "VIME_RL_KERNEL":
            monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.setenv("VIME_RL_KERNEL", "1")


@pytest.fixture
def kernels_off(monkeypatch):
    """All switches cleared: every op runs the reference."""
    import kernels

    for name in ("VIME_RL_KERNEL", "VIME_RL_KERNEL_STRICT", "VIME_RL_KERNEL_OPS", "VIME_RL_KERNEL_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    kernels.reset_fallback_counts()
    yield
    kernels.reset_fallback_counts()
