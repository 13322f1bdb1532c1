"""The largest micro-batch that fits: a search over token counts where out-of-memory is an outcome.

``largest_fitting(probe, start=..., limit=...)`` doubles the size from ``start`` until a probe runs
out of memory (or ``limit`` is reached), then bisects between the largest size that fit and the
smallest that did not until they are within ``rel_tol`` of each other (10% by default): the true
limit then lies in ``[largest, largest * (1 + rel_tol))``. The search assumes that what fits at a
size fits at every smaller one (memory grows with the tokens).

Out of memory is a measured outcome, never a crash: ``torch.OutOfMemoryError`` on CUDA, and on
CPU ``MemoryCapExceeded`` from ``MemoryCap``, the CPU stand-in for the HBM limit (below). Any
other error of a probe raises ``ProbeFailed`` naming the size and the error. Between probes the
memory is released (``release_memory``: garbage collection, the CUDA cache, the peak counter).

``MemoryCap(cap_bytes)`` (STAND-IN, CPU only: a CPU has no HBM limit to run into) is a
``TorchDispatchMode`` that counts the bytes of every tensor storage an op creates while it is
active, until the storage is freed, and raises ``MemoryCapExceeded`` at the op that takes the live
bytes past the cap, as the CUDA allocator raises at the allocation it cannot serve. What it counts
is what the probe allocates above what was alive when it started (the model's parameters); memory
outside torch's tensors (numpy buffers of Triton's interpreter, Python objects) is not counted.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DEFAULT_REL_TOL = 0.10  # the resolution: the largest size found within 10% of the true limit


class MemoryCapExceeded(RuntimeError):
    """STAND-IN for ``torch.OutOfMemoryError`` on CPU: a probe's live tensor bytes passed the cap."""


class ProbeFailed(RuntimeError):
    """A probe failed with an error that is not out-of-memory: the run stops with its reason."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a measured out-of-memory: the CUDA allocator's, or the CPU cap's."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryCapExceeded))


def release_memory(device: torch.device) -> None:
    """Free what the last probe left (its tensors, the CUDA allocator's cached blocks) and start a
    fresh peak counter, so that each probe measures its own peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class MemoryCap(TorchDispatchMode):
    """STAND-IN for the HBM limit on CPU (see the module docstring): ``with MemoryCap(n) as cap:``
    raises ``MemoryCapExceeded`` once the storages created inside hold more than ``n`` bytes;
    ``cap.peak_bytes`` is the most they held at once."""

    def __init__(self, cap_bytes: int | None) -> None:
        super().__init__()
        if cap_bytes is not None and cap_bytes <= 0:
            raise ValueError(f"MemoryCap: cap_bytes must be > 0 or None, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, weakref.finalize] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self._live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._live or key in inputs:
                continue  # a view of, or an in-place op on, a storage that exists already
            self._live[key] = weakref.finalize(storage, self._freed, key, nbytes)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            if self.cap_bytes is not None and self.live_bytes > self.cap_bytes:
                live = self.live_bytes
                del out, tensor, storage
                raise MemoryCapExceeded(
                    f"CPU memory cap (stand-in for the HBM limit): {live / 2**20:.1f} MiB live after "
                    f"{func}, cap {self.cap_bytes / 2**20:.1f} MiB")
        return out


@dataclasses.dataclass
class Probe:
    """One size tried: whether it fit, what it measured (the probe's own dict), or why not."""

    tokens: int
    fits: bool
    measured: dict[str, Any] = dataclasses.field(default_factory=dict)
    out_of_memory: str | None = None  # the error's first line when it did not fit


@dataclasses.dataclass
class SearchResult:
    largest: int | None  # the largest size that fit; None: not even ``start`` fit
    smallest_failing: int | None  # the smallest size that ran out of memory; None: ``limit`` fit
    probes: list[Probe]
    rel_tol: float

    @property
    def bounded_by_limit(self) -> bool:
        """True when the search stopped at its ``limit`` without running out of memory."""
        return self.largest is not None and self.smallest_failing is None

    def fitted(self) -> list[Probe]:
        return sorted((p for p in self.probes if p.fits), key=lambda p: p.tokens)

    def probe_at(self, tokens: int) -> Probe:
        return next(p for p in self.probes if p.tokens == tokens)


def run_probe(measure: Callable[[int], dict[str, Any]], tokens: int, device: torch.device) -> Probe:
    """``measure(tokens)`` as one probe: a dict of what it measured when it fits, an out-of-memory
    outcome when it does not; any other error raises ``ProbeFailed`` naming the size. The memory
    is released after it (the caller releases it once before the first)."""
    oom = None
    try:
        measured = measure(tokens)
    except Exception as exc:  # noqa: BLE001 - sorted below: only out-of-memory is an outcome
        if not is_out_of_memory(exc):
            raise ProbeFailed(f"probe at {tokens} tokens failed: {type(exc).__name__}: {exc}") from exc
        oom = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        del exc  # its traceback holds the probe's tensors
    finally:
        release_memory(device)
    if oom is not None:
        return Probe(tokens, False, out_of_memory=oom)
    return Probe(tokens, True, measured)


def _rounded(tokens: int, quantum: int) -> int:
    return max(quantum, tokens // quantum * quantum)


def largest_fitting(probe: Callable[[int], Probe], *, start: int, limit: int, rel_tol: float = DEFAULT_REL_TOL,
                    quantum: int = 1) -> SearchResult:
    """The largest size in ``[start, limit]`` (multiples of ``quantum``) for which ``probe`` fits,
    to within ``rel_tol`` (see the module docstring); ``probe(tokens) -> Probe`` (``run_probe``)."""
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    if quantum < 1 or start < quantum or start % quantum or limit < start:
        raise ValueError(f"need 1 <= quantum <= start <= limit with start a multiple of quantum; got "
                         f"quantum={quantum}, start={start}, limit={limit}")
    probes: list[Probe] = []

    def tried(tokens: int) -> bool:
        result = probe(tokens)
        if result.tokens != tokens:
            raise ValueError(f"probe({tokens}) returned a Probe for {result.tokens} tokens")
        probes.append(result)
        return result.fits

    lo, hi, size = None, None, start
    while True:  # doubling
        if not tried(size):
            hi = size
            break
        lo = size
        if size >= limit:
            break
        size = min(_rounded(size * 2, quantum), _rounded(limit, quantum))
    if lo is None or hi is None:
        return SearchResult(lo, hi, probes, rel_tol)
    while hi - lo > rel_tol * lo and hi - lo > quantum:  # bisection
        mid = _rounded((lo + hi) // 2, quantum)
        if mid <= lo:
            break
        if tried(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(lo, hi, probes, rel_tol)
