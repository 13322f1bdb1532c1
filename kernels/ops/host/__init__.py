"""Host-side C++ fast paths of the launch-bound ops: Python extension modules built on first use.

A call of a few tokens is all host time; what is left of it in Python after ``kernels.launch``'s
direct launches is reading tensor attributes to check and key the inputs. A module here takes
the common case of one op's call in one C++ call (checks, outputs, ``cuLaunchKernel`` of the Triton
kernel the op's Python path compiled and registered) and returns None for anything else, so the
Python path, with its checks and error messages, stays the only one that decides and explains.

Modules: ``ratio_kl_elementwise.cpp`` (ratio_kl's call), ``grpo_loss_one_read.cpp`` (grpo_loss's
one-read call) and ``logp_single_device.cpp`` (logp's call without TP), each with a C++ autograd
node for its backward, so that neither pass enters Python; what they share is ``host_common.h``
(launching a registered Triton kernel, keys, reading call objects) and ``host_autograd.h`` (inputs
made fit for a backward kernel, the nodes' saved inputs). Each module is ``<op>_<what>.cpp``;
:class:`HostModule` builds it with ``build.py`` (g++ against the installed torch's headers,
cached) the first time the op has a kernel to register, and says so. If it cannot (no compiler, no headers), it logs the reason once and the op keeps its Python
path: the same results, more host time. With ``VIME_RL_KERNEL_FAST_LAUNCH=0`` (or on CPU, under
the Triton interpreter) nothing is registered, so nothing is built.

An op holds one :class:`HostModule` and calls through it: its common-case call reads
``HostModule.forward`` (the module's forward once a kernel is registered with it, else None) and
calls it; its launches register their kernels with :meth:`HostModule.registry`'s module and hand
the answer to :meth:`HostModule.registered`. To run an op without its host path (a test's or a
benchmark's Python path), ``with op._HOST.off():`` (a probe that launches kernels built another
way, ``off(register=False)``); to watch or replace the forward, set ``op._HOST.forward``
(``monkeypatch.setattr(op._HOST, "forward", wrapper)``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from kernels.launch import LaunchKeyError
from kernels.ops.host import build

logger = logging.getLogger("kernels")


class HostModule:
    """One ``<name>.cpp`` of this folder, built and imported on the first :meth:`load`, and its op's
    use of it: the forward the op's common-case call tries first, the registrations that turn it on,
    a switch to turn it off."""

    def __init__(self, name: str) -> None:
        self.source = Path(__file__).with_name(f"{name}.cpp")
        # the module's forward once it holds a kernel (see registered), else None: the op's call
        # reads this attribute and calls it, one attribute read of host time
        self.forward: Callable[..., Any] | None = None
        self._module: ModuleType | None = None
        self._disabled: str | None = None
        self._off = False  # inside off(): no forward
        self._unregistered = False  # inside off(register=False): no registration either
        self._stored = False  # a kernel was stored with the module
        self._lock = threading.Lock()

    def path_label(self) -> str:
        """Which path the op's common-case calls take now, for benchmark tags: ``c++`` (its host
        path holds its kernels), or ``python`` and why not."""
        if self.forward is not None:
            return "c++"
        return f"python ({'turned off' if self._off else self._disabled or 'no kernel registered'})"

    def calls_served(self) -> int:
        """The calls the module's forward served in this process (0 before it is built): a
        benchmark compares it around one call to tell whether the C++ path took that call."""
        module = self._module
        return 0 if module is None else int(module.served())

    def registry(self) -> ModuleType | None:
        """The module to register the op's kernels with (:meth:`load`), or None inside
        ``off(register=False)``."""
        return None if self._unregistered else self.load()

    def registered(self, stored: bool | None, what: str) -> None:
        """Take the answer of a registration with :meth:`registry`'s module: True stored (the first
        kernel stored turns on :attr:`forward`; inside :meth:`off`, at the block's end), None not a
        common case, False the module's key for the kernel holds another compiled kernel (its key is
        too coarse: LaunchKeyError, naming ``what``)."""
        if stored is False:
            raise LaunchKeyError(f"{self.source.stem} host path: its key for {what} holds another compiled kernel")
        if stored:
            self._stored = True
            if self.forward is None and not self._off:
                self.forward = self.load().forward

    @contextlib.contextmanager
    def off(self, *, register: bool = True) -> Iterator[None]:
        """The op's Python path alone inside: no :attr:`forward`. The Python path still registers
        the kernels it launches (its launcher serves a kernel's later launches without passing the
        registration again, so a kernel first launched here would never reach the host path
        otherwise); ``register=False`` stops that too (a probe that launches kernels built another
        way under keys the module holds). On exit, :attr:`forward` as it was, or on if the block
        stored the first kernel."""
        forward, was_off, was_unregistered = self.forward, self._off, self._unregistered
        self.forward, self._off, self._unregistered = None, True, was_unregistered or not register
        try:
            yield
        finally:
            self._off, self._unregistered = was_off, was_unregistered
            if forward is None and self._stored and not was_off:
                forward = self.load().forward
            self.forward = forward

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
