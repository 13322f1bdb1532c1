"""pytest-rlk's operators: vime's selected log-prob, ratio/KL and GRPO loss (and linear_logp).

Public API (kernels/api.py): ``logp``, ``ratio_kl``, ``grpo_loss``, ``linear_logp`` check their
inputs against the op's contract (kernels/contracts/) and run on the backend chosen by
:mod:`kernels.dispatch` (the reference by default; ``VIME_RL_KERNEL=1`` turns on the Triton
kernels). ``kernels.reference`` holds the fp32 references of vime's exact math;
``kernels.settings`` every environment variable the project reads. ``raise_pending_errors()``
raises bad input that the kernels found on the device without a host sync (ids out of range,
inconsistent packing; kernels/device_errors.py): call it where the training loop syncs anyway.

Importing ``kernels`` is cheap: the API (and torch) load on first use of a name below, so the
pytest plugin and ``rlk env`` can read ``kernels.settings`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__rlk_kernels__ = True
__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "logp": "kernels.api",
    "ratio_kl": "kernels.api",
    "grpo_loss": "kernels.api",
    "linear_logp": "kernels.api",
    "IGNORE_INDEX": "kernels.contracts",
    "LossConfig": "kernels.contracts",
    "KernelFallbackError": "kernels.dispatch",
    "backend_id": "kernels.dispatch",
    "fallback_counts": "kernels.dispatch",
    "fallback_reasons": "kernels.dispatch",
    "reset_fallback_counts": "kernels.dispatch",
    "raise_pending_errors": "kernels.device_errors",
    "DeviceInputError": "kernels.device_errors",
}

if TYPE_CHECKING:
    from kernels import reference
    from kernels.api import grpo_loss, linear_logp, logp, ratio_kl
    from kernels.contracts import IGNORE_INDEX, LossConfig
    from kernels.device_errors import DeviceInputError, raise_pending_errors
    from kernels.dispatch import (
        KernelFallbackError,
        backend_id,
        fallback_counts,
        fallback_reasons,
        reset_fallback_counts,
    )


def __getattr__(name: str) -> Any:
    """A public name (loaded from its module on first use) or a submodule (``kernels.reference``)."""
    module = _PUBLIC.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name.startswith("__"):
        raise AttributeError(name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, "reference"})


__all__ = [
    "IGNORE_INDEX",
    "DeviceInputError",
    "KernelFallbackError",
    "LossConfig",
    "backend_id",
    "fallback_counts",
    "fallback_reasons",
    "grpo_loss",
    "linear_logp",
    "logp",
    "raise_pending_errors",
    "ratio_kl",
    "reference",
    "reset_fallback_counts",
]
