"""What the operators' real implementations share: which backend serves a call, the call rebuilt
from the operator's arguments, and the backward of a backend that has no split of its own.

An operator's real implementation runs once per call at run time, in eager and compiled code
alike, so :func:`serving` is the dispatch of every call (kernels/dispatch.py: switches read now,
fallbacks counted and logged, strict mode raising). The forward and the backward each ask; both
get the same backend while the switches stay the same between them.

Backends and splits. A backend's implementation of an op is one function with autograd
(kernels/backends/base.py). An operator needs its forward and backward apart: a backend may have
a *split* for an op (kernels/library/<op>.py names them: the forward returns the outputs and the
residuals its backward reads), and any other backend runs the generic split here: the forward
without autograd, the backward recomputing the forward with autograd and differentiating it
(:func:`recomputed_grads`), which gives the bits of the backend's own backward at the cost of one
more forward (autograd recorded inside the operator: kernels/library/torch_internals.py).
Residuals have one layout per op whatever backend serves the call at run time (the fake
implementation states it without knowing which will); linear_logp's layout, which its workspace
plan decides, is an argument of the operator, computed while the public function is traced (the
settings it reads become guards) and checked by the forward that runs.

Vocab-parallel calls: an operator takes the process group by its registered name
(:func:`registered_name`, as PyTorch's functional collectives do); :func:`tp_fields` resolves it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, fields
from typing import Any, TypeVar

import torch

from kernels import backends, device_errors, dispatch
from kernels.contracts import checks
from kernels.contracts.call import tp_world
from kernels.library.torch_internals import autograd_inside, process_group

C = TypeVar("C")


def serving(op: str, call: Any) -> tuple[str | None, Callable[[Any], Any]]:
    """(split key, implementation) that serves ``op``'s checked ``call`` now (as ``dispatch.run``).

    The split key is the backend's id where the backend's own split computes what its
    ``get(op)`` computes (:func:`split_key`), else None: the generic split then runs ``impl``."""
    if not dispatch.kernels_enabled():  # the default: the reference, without building the case
        backend = backends.get_backend(dispatch.REFERENCE_BACKEND)
        impl = backend.get(op)
    else:
        backend, impl = dispatch.select(op, **call.case())
    if op not in getattr(backend, "checks_values", ()):
        checks.check_call_values(call)
    return split_key(backend, op), impl


def split_key(backend: Any, op: str) -> str | None:
    """The key of ``backend``'s split of ``op`` in kernels/library/<op>.py's ``SPLITS``: its id
    where ``backend`` vouches that its routes compute what ``get(op)`` does
    (``serves_own_routes(op)``, kernels/backends/triton.py), else None. A backend that shares an id
    with ours but not its code (a subclass overriding ``get``, a third party reusing the name)
    never gets our split."""
    own = getattr(backend, "serves_own_routes", None)
    return backend.id if own is not None and own(op) else None


def check_values(op: str, call: Any, ids: torch.Tensor, num_tokens: int, vocab: int) -> None:
    """The value checks (ids range, packed lengths) of a forward operator's call, at run time: the
    public function skips them while it is traced. CPU tensors (or ``strict``): now, on the host;
    device tensors: left to the kernels of a backend that checks them (a call id for the device
    error word, kernels/device_errors.py), else to :func:`serving`'s host check."""
    mode = checks.defer_value_check(ids)
    if mode is False:
        call.check_values()
    call.deferred = device_errors.begin_call(op, num_tokens, vocab) if mode else 0


def trusted(call_type: type[C], **values: Any) -> C:
    """A ``call_type`` (a contract's call) with these field values, without running its checks:
    the public function checked the same values before it called the operator. Fields not given
    take their defaults; derived fields (``init=False``) must be given."""
    call = object.__new__(call_type)
    for f in fields(call_type):  # type: ignore[arg-type]
        if f.name in values:
            value = values[f.name]
        elif f.default is not MISSING:
            value = f.default
        elif f.default_factory is not MISSING:
            value = f.default_factory()
        else:
            raise TypeError(f"{call_type.__name__}.{f.name} must be given")
        setattr(call, f.name, value)
    return call


def recomputed_grads(
    run: Callable[..., Any], primals: Sequence[torch.Tensor | None], needs: Sequence[bool],
    grad_outputs: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """The generic backward: ``run(*leaves)`` (the backend's forward with autograd, on detached
    copies of ``primals``) differentiated at ``grad_outputs``; one gradient per primal, ``None``
    where ``needs`` is false (zeros where the output does not depend on it)."""
    leaves = [p.detach().requires_grad_(n) if p is not None else None for p, n in zip(primals, needs, strict=True)]
    wanted = [leaf for leaf, n in zip(leaves, needs, strict=True) if n and leaf is not None]
    with autograd_inside():
        outputs = run(*leaves)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        found = iter(torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True))
    grads: list[torch.Tensor | None] = []
    for leaf, n in zip(leaves, needs, strict=True):
        if not n or leaf is None:
            grads.append(None)
            continue
        grad = next(found)
        grads.append(torch.zeros_like(leaf) if grad is None else grad)
    return grads


def registered_name(group: torch.distributed.ProcessGroup | None) -> str | None:
    """What an operator's schema takes for a process group: its registered name, or None
    (kernels/library/torch_internals.py resolves it back)."""
    return None if group is None else group.group_name


def tp_fields(group_name: str | None) -> dict[str, Any]:
    """A call's ``tp_group`` and ``tp_world`` for an operator's ``group_name`` argument."""
    group = process_group(group_name)
    return {"tp_group": group, "tp_world": tp_world(group)}


def needs_grad(*tensors: torch.Tensor | None) -> list[bool]:
    """Which inputs the caller differentiates (an operator's inputs never require grad inside it)."""
    on = torch.is_grad_enabled()
    return [on and t is not None and t.requires_grad for t in tensors]


__all__ = ["autograd_inside", "check_values", "needs_grad", "recomputed_grads", "registered_name", "serving",
           "tp_fields", "trusted"]
