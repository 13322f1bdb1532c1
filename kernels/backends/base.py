"""The Backend interface: what an implementation of our ops must provide to be dispatched to.

A backend is an object with:

* ``id`` / ``version`` (strings; ``kernels.backend_id()`` reports ``f"{id}/{version}"``);
* ``capabilities``: a :class:`Capabilities` (what it claims, for tables and quick rejection);
* ``supports(op, **case) -> str | None``: ``None`` when it can run this exact case, else a short
  human-readable reason (it becomes the fallback log line and the strict-mode error);
* ``get(op) -> Callable``: the implementation, a function of one checked call of the op
  (``impl(call)``, ``call`` a ``kernels.contracts.LogpCall``, ``RatioKLCall``, ``GrpoLossCall`` or
  ``LinearLogpCall``: its fields are the public function's arguments, already checked; the
  contract modules in kernels/contracts/ state shapes, dtypes and math). It returns what the
  public function returns.

Optional: ``host_first(op) -> Callable | None``, an entry that takes the public function's raw
arguments and returns its result, or None to decline (``kernels.dispatch.run_host_first``; the
public ``logp`` and ``ratio_kl`` ask for it before building their call). It serves only calls the contract
accepts and ``supports`` admits, with the bits ``get(op)(call)`` gives; it checks whatever it
relies on itself and declines anything else, which the contract then checks and names. It is
where a call of a few tokens saves the host time of building, checking and dispatching the call.

The ``case`` passed to ``supports`` (``call.case()``; keys are stable, a backend ignores what it
does not need):

======================  =================================================================
``device``              ``torch.device`` of the main input (logits, logp or hidden)
``dtype``               ``torch.dtype`` of the main input
``shape``               tuple, shape of the main input
``temperature``         float (``logp``/``grpo_loss``/``linear_logp``)
``tp_world``            int, 1 without a tensor-parallel group
``config``              ``LossConfig`` (``grpo_loss``)
``kl_type``             str (``ratio_kl``)
``use_unbiased_kl``     bool (``ratio_kl``)
``inplace_backward``    bool (``grpo_loss``)
``requires_grad``       bool, of the main input
``num_samples``         int, packed samples (``grpo_loss``; 1 without lengths/cu_seqlens)
======================  =================================================================

Register a backend with ``kernels.backends.register_backend(name, factory)``, by dotted path
``VIME_RL_KERNEL_BACKEND=pkg.module:factory``, or through the entry-point group
``pytest_rlk.backends`` (name -> ``pkg.module:factory``). ``factory()`` returns the backend.
:class:`BaseBackend` derives ``supports`` from the capabilities; override ``check_case`` for
finer rules.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

OPS = ("logp", "ratio_kl", "grpo_loss", "linear_logp")


@dataclass(frozen=True)
class Capabilities:
    """What a backend claims to support. Empty ``ops`` means none."""

    ops: frozenset[str] = frozenset()
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    temperature: bool = True  # any temperature > 0, not just 1.0
    clip_shapes: frozenset[str] = frozenset({"symmetric", "asymmetric"})
    kl_types: frozenset[str] = frozenset({"k1", "k2", "k3", "low_var_kl"})
    reductions: frozenset[str] = frozenset({"sum_of_sample_mean", "per_token_sum"})
    tp: bool = True  # vocab-parallel over a process group
    autograd: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    id: str
    version: str
    capabilities: Capabilities

    def supports(self, op: str, **case: Any) -> str | None: ...

    def get(self, op: str) -> Callable[..., Any]: ...


@functools.cache
def import_function(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported on first use (a backend loads an op's module only when it serves it)."""
    return getattr(importlib.import_module(module), name)


class BaseBackend:
    """Convenience base: ``supports`` checks the case against ``capabilities`` then ``check_case``."""

    id: str = "base"
    version: str = "0"
    capabilities: Capabilities = Capabilities()

    def supports(self, op: str, **case: Any) -> str | None:
        caps = self.capabilities
        if op not in caps.ops:
            return f"{self.id} does not implement {op}"
        dtype = case.get("dtype")
        if dtype is not None and dtype not in caps.dtypes:
            return f"dtype {dtype} not supported by {self.id}"
        device = case.get("device")
        if device is not None and torch.device(device).type not in caps.devices:
            return f"device {torch.device(device).type} not supported by {self.id}"
        temperature = case.get("temperature")
        if temperature is not None and temperature != 1.0 and not caps.temperature:
            return f"temperature != 1 not supported by {self.id}"
        if case.get("tp_world", 1) > 1 and not caps.tp:
            return f"vocab-parallel (tp_world={case['tp_world']}) not supported by {self.id}"
        if case.get("requires_grad") and not caps.autograd:
            return f"{self.id} has no backward"
        config = case.get("config")
        kl_type = case.get("kl_type", getattr(config, "kl_type", None))
        if kl_type is not None and kl_type not in caps.kl_types:
            return f"kl_type {kl_type} not supported by {self.id}"
        if config is not None:
            shape = "symmetric" if config.eps_clip == config.eps_clip_high else "asymmetric"
            if shape not in caps.clip_shapes:
                return f"{shape} clip not supported by {self.id}"
            if config.reduction not in caps.reductions:
                return f"reduction {config.reduction} not supported by {self.id}"
        return self.check_case(op, **case)

    def check_case(self, op: str, **case: Any) -> str | None:
        """Finer, backend-specific rules; ``None`` = supported."""
        return None

    def get(self, op: str) -> Callable[..., Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.id}/{self.version}>"
