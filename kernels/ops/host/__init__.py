"""Host-side C++ fast paths of the launch-bound ops: Python extension modules built on first use.

A call of a few tokens is all host time; what is left of it in Python after ``kernels.launch``'s
direct launches is reading tensor attributes to check and key the inputs. A module here takes
the common case of one op's call in one C++ call (checks, outputs, ``cuLaunchKernel`` of the Triton
kernel the op's Python path compiled and registered) and returns None for anything else, so the
Python path, with its checks and error messages, stays the only one that decides and explains.

Modules: ``ratio_kl_forward.cpp`` (ratio_kl's no-grad forward), ``grpo_loss_one_read.cpp``
(grpo_loss's one-read forward) and ``logp_single_device.cpp`` (logp's forward without TP), the last
two with a C++ autograd node for their backward, so that neither pass enters Python; what they
share is ``host_common.h`` (launching a registered Triton kernel, keys, reading call objects) and
``host_autograd.h`` (the node's saved inputs). Each module is ``<op>_<what>.cpp``;
:class:`HostModule` builds it with ``build.py`` (g++ against the installed torch's headers,
cached) the first time the op has a kernel to register, and says so. If it cannot (no compiler, no headers), it logs the reason once and the op keeps its Python
path: the same results, more host time. With ``VIME_RL_KERNEL_FAST_LAUNCH=0`` (or on CPU, under
the Triton interpreter) nothing is registered, so nothing is built.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import ModuleType

from kernels.ops.host import build

logger = logging.getLogger("kernels")


class HostModule:
    """One ``<name>.cpp`` of this folder, built and imported on the first :meth:`load`."""

    def __init__(self, name: str) -> None:
        self.source = Path(__file__).with_name(f"{name}.cpp")
        self._module: ModuleType | None = None
        self._disabled: str | None = None
        self._lock = threading.Lock()

    def path_label(self, holds_kernels: bool) -> str:
        """Which path an op's common-case calls take now, for benchmark tags: ``c++`` (the op's
        host path holds its kernels), or ``python`` and why not."""
        if holds_kernels:
            return "c++"
        return f"python ({self._disabled or 'no kernel registered'})"

    def disabled_reason(self) -> str | None:
        """Why this module is not in use (None: loaded, or not tried yet)."""
        return self._disabled

    def load(self) -> ModuleType | None:
        """The module, built now if needed (seconds, once per torch version and source; logged),
        or None if it cannot be (the reason logged once, kept in :meth:`disabled_reason`)."""
        if self._module is not None or self._disabled is not None:
            return self._module
        with self._lock:
            if self._module is None and self._disabled is None:
                try:
                    self._module = build.load_extension(self.source)
                except Exception as exc:  # a compiler error, missing headers, an import failure
                    self._disabled = f"{type(exc).__name__}: {exc}"
                    logger.warning("kernels: %s host path off, the op keeps its Python path: %s",
                                   self.source.stem, self._disabled)
        return self._module
