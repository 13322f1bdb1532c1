"""How a contract's call class becomes a function with the op's signature, and what ``supports`` sees.

Each op states its arguments once, as the fields of a dataclass (``LogpCall``, ...), whose
``__post_init__`` checks them. :func:`entry_point` turns a function of one such call into a
function of the op's arguments: ``logp(logits, ids)`` is ``run(LogpCall(logits, ids))``. The public
API, the reference and the Triton ops define their keyword entry points this way, so the signature
is written in one place and every entry checks its inputs the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from kernels.contracts.checks import check_call_values

P = ParamSpec("P")
C = TypeVar("C")
R = TypeVar("R")


def entry_point(call_type: Callable[P, C], run: Callable[[C], R], *, name: str | None = None,
                doc: str | None = None, checks_values: bool = False,
                first: Callable[[tuple, dict], R | None] | None = None) -> Callable[P, R]:
    """``f(*args, **kwargs) = run(call_type(*args, **kwargs))``, with the call type's signature
    (``help()``, ``inspect.signature``), ``run``'s name (or ``name``) and, as its docstring, ``doc``
    or ``run``'s followed by the call type's (the contract). ``f.run`` is ``run``.

    ``checks_values``: ``run``'s kernels check the values a call leaves to the device (ids range,
    lengths; kernels/device_errors.py). Otherwise those checks run on the host before ``run``
    (checks.check_call_values; a host sync for device tensors).

    ``first``: ``first(args, kwargs)`` runs before the call is built, and its result, unless None,
    is the call's (``kernels.dispatch.run_host_first``: a backend's host path that checks what it
    relies on itself and declines everything else, whose call is then built and checked here)."""

    if first is not None:
        def entry(*args: P.args, **kwargs: P.kwargs) -> R:
            out = first(args, kwargs)
            if out is not None:
                return out
            call = call_type(*args, **kwargs)
            if not checks_values:
                check_call_values(call)
            return run(call)
    elif checks_values:
        def entry(*args: P.args, **kwargs: P.kwargs) -> R:
            return run(call_type(*args, **kwargs))
    else:
        def entry(*args: P.args, **kwargs: P.kwargs) -> R:
            call = call_type(*args, **kwargs)
            check_call_values(call)
            return run(call)

    entry.__name__ = entry.__qualname__ = name or run.__name__
    entry.__module__ = run.__module__
    if doc is None:
        doc = "\n\n".join(inspect.cleandoc(d) for d in (run.__doc__, call_type.__doc__) if d)
    entry.__doc__ = doc
    entry.__signature__ = inspect.signature(call_type).replace(  # type: ignore[attr-defined]
        return_annotation=inspect.signature(run).return_annotation)
    entry.run = run  # type: ignore[attr-defined]
    return entry


def tp_world(tp_group: dist.ProcessGroup | None) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def tensor_case(x: torch.Tensor) -> dict[str, Any]:
    """The main input's part of the ``case`` a backend's ``supports(op, **case)`` receives."""
    return {"device": x.device, "dtype": x.dtype, "shape": tuple(x.shape), "requires_grad": x.requires_grad}


__all__ = ["entry_point", "tensor_case", "tp_world"]
