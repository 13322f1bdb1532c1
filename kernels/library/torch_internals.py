"""The private PyTorch APIs the operators rely on, in one place, each with why no public API does it.

suites/op/torch_library/test_torch_library_torch_internals.py::test_private_torch_apis_work calls each one and fails naming
the API if a PyTorch release removes or changes it (checked on torch 2.11-2.13).

* :func:`autograd_inside`: autograd recording inside an operator's implementation. The
  dispatcher runs a custom operator's implementation below the autograd keys (excluded in the
  thread's dispatch state), so ``torch.enable_grad()`` alone records nothing there. The generic
  split (kernels/library/serve.py) differentiates a backend's own implementation inside the
  operator, for backends that have no split of their own. The public transform,
  ``torch.func.vjp``, does record there, but refuses every ``autograd.Function`` without a
  ``setup_context`` (Liger's, the reference's vocab-parallel ones, any third-party backend's):
  the generic split would then serve only some backends.
* :func:`process_group`: the process group of a group name. An operator's schema cannot take a
  ``ProcessGroup``, so vocab-parallel calls pass ``group.group_name`` (a ``str``) as PyTorch's
  functional collectives do, and the implementation resolves it with the same registry lookup
  they use (``torch.distributed`` has no public resolver through 2.13).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView))


@contextlib.contextmanager
def autograd_inside() -> Iterator[None]:
    """Autograd recording inside an operator's implementation: the autograd keys leave the
    thread's excluded set for the block, every other excluded key stays excluded."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    included = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(included, excluded - _AUTOGRAD_KEYS), torch.enable_grad():
        yield


def process_group(group_name: str | None) -> dist.ProcessGroup | None:
    """The process group registered under ``group_name`` (``ProcessGroup.group_name``), or None."""
    if group_name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


__all__ = ["autograd_inside", "process_group"]
