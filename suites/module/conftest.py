"""Module tier setup.

Without a GPU the Triton kernels run through Triton's interpreter, which must be switched on
before ``kernels.ops`` is first imported in the process (``triton.jit`` reads it at decoration).
Spawned worker processes inherit the environment variable.
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


@pytest.fixture
def device() -> torch.device:
    """Where kernel-arm tensors live: the GPU when there is one (the Triton interpreter is only
    switched on for CPU-only hosts), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def kernels_arm(monkeypatch):
    """``kernels_arm(True|False)``: our Triton kernels, or the same code paths on the fp32 reference
    backend (strict, so a fallback fails loudly). The reference arm keeps the kernels switch on with
    ``VIME_RL_KERNEL_BACKEND=reference``: with the switch off the vime adapter hands its calls to vime's
    own loss, which is not installed here. ``kernels_arm("name or module:factory")`` selects another
    backend the same way (a control arm)."""
    import kernels

    def switch(on: bool | str) -> None:
        backend = on if isinstance(on, str) else ("rlk-triton" if on else "reference")
        monkeypatch.setenv("VIME_RL_KERNEL", "1")
        monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", backend)
        monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
        kernels.reset_fallback_counts()

    yield switch
    kernels.reset_fallback_counts()


@pytest.fixture(scope="session")
def drift_cases(tmp_path_factory):
    """{"dense", "moe"}: the drift models and the responses every drift check scores. One vLLM
    subprocess rolls out both models (~60 s on two cores), shared by every test of the session;
    without vLLM, transformers samples them and the rollout-side checks skip with the reason."""
    from pytest_rlk.drift.rollout import RolloutError
    from suites.module import tiny

    try:
        return tiny.roll_out_drift_models(tmp_path_factory.mktemp("drift-models"))
    except RolloutError as exc:
        pytest.fail(str(exc), pytrace=False)
