"""The largest micro-batch that fits: a search over token counts where out-of-memory is an outcome.

``largest_fitting(probe, start=..., limit=...)`` doubles the size from ``start`` until a probe runs
out of memory (or ``limit`` is reached), then narrows the bracket between the largest size that fit
and the smallest that did not until they are within ``rel_tol`` of each other (10% by default): the
true limit then lies in ``[largest, largest * (1 + rel_tol))``. The search assumes that what fits at
a size fits at every smaller one (memory grows with the tokens).

The search doubles and narrows by bisection, unless the caller gives the memory a probe may take
(``headroom_bytes``) and how to read a probe's peak (``peak_of``). Then, once two sizes fit, the
next size comes from the line through the peaks of the two largest sizes that fit (a step's memory
is close to affine in its tokens): just below where the line meets the headroom, then the top of
the ``rel_tol`` window above the largest fit. While doubling, once three sizes lie on one line
(``steady_line``), that is a leap past the doublings in between (from 16384 tokens straight to near
half a million, where a probe of a 0.6B model is a step of ~10 s); while narrowing, it closes the bracket in two probes instead of the four a
bisection of a doubling step takes. A probe whose outcome the line got wrong (fragmentation, a
workspace that does not grow with the tokens) hands the rest of the search to doubling (below a
leap that ran out of memory) or to bisection, so the result is as exact either way: every probe
lies strictly inside the bracket.

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


def predicted_limit(fitted: list[tuple[int, int]], headroom_bytes: int) -> float | None:
    """The size where the line through the peaks of the two largest fitting sizes ``(tokens, peak
    bytes)`` reaches ``headroom_bytes``; None without two such sizes or a rising line."""
    if len(fitted) < 2:
        return None
    (n1, p1), (n2, p2) = sorted(fitted)[-2:]
    if n2 <= n1 or p2 <= p1:
        return None
    return n2 + (headroom_bytes - p2) * (n2 - n1) / (p2 - p1)


def _guided_size(lo: int, hi: int, limit: float | None, rel_tol: float, quantum: int) -> tuple[int, bool] | None:
    """(the next size, whether the line expects it to fit) inside ``(lo, hi)``, or None (bisect)."""
    if limit is None:
        return None
    below = _rounded(int(limit * (1 - rel_tol / 2)), quantum)
    if lo < below < hi:  # the line's limit lies above the window: a size just below it should fit
        return below, True
    top = _rounded(max(int(lo * (1 + rel_tol)), lo + quantum), quantum)  # the limit lies in the window: its top should not
    return (top, False) if lo < top < hi else None


LINE_SLOPE_AGREEMENT = 0.25  # a leap needs the last two slopes of the peaks within this of each other


def steady_line(fitted: list[tuple[int, int]]) -> bool:
    """Whether the peaks of the three largest fitting sizes lie on one line: both slopes rising and
    within ``LINE_SLOPE_AGREEMENT`` of each other. At small sizes a workspace that stops growing at
    its cap (linear_logp's) or fixed buffers flatten the first slope, and a line through them
    overshoots the limit by orders of magnitude."""
    if len(fitted) < 3:
        return False
    (n1, p1), (n2, p2), (n3, p3) = sorted(fitted)[-3:]
    if not n1 < n2 < n3:
        return False
    s1, s2 = (p2 - p1) / (n2 - n1), (p3 - p2) / (n3 - n2)
    return s1 > 0 and s2 > 0 and abs(s2 - s1) <= LINE_SLOPE_AGREEMENT * max(s1, s2)


def _leap(lo: int, line_limit: float | None, top_size: int, rel_tol: float, quantum: int) -> tuple[int, bool] | None:
    """While doubling: (the next size, whether the line expects it to fit) from the line's limit, or
    None (double). Just below the line's limit where that lies above ``lo`` (``top_size`` where the
    line says it fits), else the top of the ``rel_tol`` window above ``lo``."""
    if line_limit is None:
        return None
    below = _rounded(int(line_limit * (1 - rel_tol / 2)), quantum)
    if below >= top_size:
        return top_size, True
    if below > lo:
        return below, True
    top = _rounded(max(int(lo * (1 + rel_tol)), lo + quantum), quantum)
    return (top, False) if lo < top <= top_size else None


def _fitted_peaks(probes: list[Probe], peak_of: Callable[[Probe], int | None]) -> list[tuple[int, int]]:
    """(tokens, peak bytes) of every probe that fit and reports a peak: the points of the line."""
    return [(p.tokens, peak) for p in probes if p.fits and (peak := peak_of(p)) is not None]


def largest_fitting(probe: Callable[[int], Probe], *, start: int, limit: int, rel_tol: float = DEFAULT_REL_TOL,
                    quantum: int = 1, headroom_bytes: int | None = None,
                    peak_of: Callable[[Probe], int | None] | None = None) -> SearchResult:
    """The largest size in ``[start, limit]`` (multiples of ``quantum``) for which ``probe`` fits,
    to within ``rel_tol`` (see the module docstring); ``probe(tokens) -> Probe`` (``run_probe``).
    With ``headroom_bytes`` (the bytes a probe may take above what it starts from) and ``peak_of``
    (a fitting probe's peak in the same terms), the bracket narrows along the line of the peaks."""
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    if (headroom_bytes is None) != (peak_of is None):
        raise ValueError("headroom_bytes and peak_of come together (the line needs both)")
    if headroom_bytes is not None and headroom_bytes <= 0:
        raise ValueError(f"headroom_bytes must be > 0, got {headroom_bytes}")
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

    guided = leaping = headroom_bytes is not None
    top_size = _rounded(limit, quantum)
    lo, hi, size, expected = None, None, start, None
    failed_leap = None  # a leap the line got wrong: out of memory there, the doubling resumes below it
    while True:  # doubling, or a leap along the line of the peaks
        fits = tried(size)
        if expected is not None and fits != expected:
            leaping = False  # the memory left the line here: doubling from now on
        if not fits and expected:
            failed_leap = size
        elif not fits:
            hi = size
            break
        else:
            lo = size
            if size >= top_size:
                break
        size, expected = min(_rounded(lo * 2, quantum), top_size), None
        if leaping:
            peaks = _fitted_peaks(probes, peak_of)
            if steady_line(peaks):
                step = _leap(lo, predicted_limit(peaks, headroom_bytes), top_size, rel_tol, quantum)
                if step is not None:
                    size, expected = step
        if failed_leap is not None and size >= failed_leap:
            hi = failed_leap
            break
    if lo is None or hi is None:
        return SearchResult(lo, hi, probes, rel_tol)
    while hi - lo > rel_tol * lo and hi - lo > quantum:
        step = None
        if guided:
            step = _guided_size(lo, hi, predicted_limit(_fitted_peaks(probes, peak_of), headroom_bytes), rel_tol, quantum)
        if step is None:  # bisection
            size, expected = _rounded((lo + hi) // 2, quantum), None
            if size <= lo:
                break
        else:
            size, expected = step
        fits = tried(size)
        if expected is not None and fits != expected:
            guided = False  # the memory left the line here: bisection from now on
        if fits:
            lo = size
        else:
            hi = size
    return SearchResult(lo, hi, probes, rel_tol)
