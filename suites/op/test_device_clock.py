"""kernels/device_clock.py: stage times on the GPU's own clock, read without a host sync.

CPU: a CPU device is refused, naming the alternative; a slot outside the clock is refused.
GPU: a stage that spins the GPU for a known time reads that time, within the margin of CUDA
events timing the same stage; taking the stamps and the time never waits for the device.
"""

from __future__ import annotations

import pytest
import torch

from kernels.device_clock import DeviceClock


def test_a_cpu_device_and_a_slot_outside_the_clock_are_refused():
    with pytest.raises(ValueError, match=r"DeviceClock needs a CUDA device, got cpu \(time a CPU with time.perf_counter\)"):
        DeviceClock(torch.device("cpu"), 2)
    with pytest.raises(ValueError, match="slots must be >= 2"):
        DeviceClock(torch.device("cuda"), 1)


@pytest.mark.gpu
@pytest.mark.exclusive_gpu  # compares two clocks over a timed stage
def test_the_clock_times_a_stage_as_cuda_events_do_without_waiting():
    clock = DeviceClock(torch.device("cuda"), 4)
    with pytest.raises(IndexError, match="slot 4 is outside the clock's 4 slots"):
        clock.stamp(4)
    clock.stamp(0)
    clock.stamp(1)  # compiles once: the timed stamps below run from the cache
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        start.record()
        clock.stamp(2)
        torch.cuda._sleep(50_000_000)  # ~25 ms at 2 GHz: long against launch and clock granularity
        clock.stamp(3)
        end.record()
        elapsed = clock.elapsed_ms(2, 3)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert elapsed.device.type == "cuda" and elapsed.dtype == torch.float32 and elapsed.dim() == 0
    end.synchronize()
    events_ms = start.elapsed_time(end)
    assert 0.0 < float(elapsed) <= events_ms + 0.05, (float(elapsed), events_ms)
    assert float(elapsed) >= 0.9 * events_ms, (float(elapsed), events_ms)
