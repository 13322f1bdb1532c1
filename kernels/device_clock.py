"""Stage times taken on the GPU's own clock, so that timing a stage never makes the host wait.

A CUDA event's ``elapsed_time`` can only be read on the host once the event has run, so a caller
that returns stage times with its results (the vime adapter's ``rlk_*_ms`` metrics, once per
micro-batch) would synchronize the device every call, and drain the training loop's launch queue.
Here a one-thread kernel writes the GPU's ``%globaltimer`` (nanoseconds) into a device buffer where
a stage starts and where it ends, and a stage's time is a 0-dim fp32 device tensor computed from
two stamps: the caller logs it like any metric, and it is read whenever the training loop reads
its metrics. As with CUDA events, a stage's time is the device's time between the stamps, which
includes any wait for the host's launches inside the stage.

    clock = DeviceClock(device, slots=2)
    clock.stamp(0); ...; clock.stamp(1)
    clock.elapsed_ms(0, 1)  # 0-dim fp32 tensor on ``device``

CUDA devices only (the Triton kernel is compiled; a CPU caller times with ``time.perf_counter``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import CachedLaunch


@triton.jit(do_not_specialize=["slot"])
def _stamp_kernel(stamps_ptr, slot):
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(stamps_ptr + slot, now)


_STAMP = CachedLaunch(_stamp_kernel)


class DeviceClock:
    """``slots`` timestamps (int64 ns) on a CUDA ``device``, each written by :meth:`stamp` on the
    current stream when the device reaches it."""

    def __init__(self, device: torch.device, slots: int) -> None:
        if device.type != "cuda":
            raise ValueError(f"DeviceClock needs a CUDA device, got {device} (time a CPU with time.perf_counter)")
        if slots < 2:
            raise ValueError(f"slots must be >= 2 (a start and an end), got {slots}")
        self.stamps = torch.empty(slots, dtype=torch.int64, device=device)  # each slot is read after its stamp

    def stamp(self, slot: int) -> None:
        if not 0 <= slot < self.stamps.shape[0]:
            raise IndexError(f"slot {slot} is outside the clock's {self.stamps.shape[0]} slots")
        _STAMP.launch((1,), self.stamps, slot)

    def elapsed_ms(self, start: int, end: int) -> torch.Tensor:
        """Milliseconds from stamp ``start`` to stamp ``end``: a 0-dim fp32 tensor on the device."""
        return (self.stamps[end] - self.stamps[start]).to(torch.float32) / 1e6


__all__ = ["DeviceClock"]
