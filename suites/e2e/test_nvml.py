"""NVML peak-memory poller: a clean "no NVML device" on CPU, real peaks on a GPU."""

from __future__ import annotations

import time

import pytest

from pytest_rlk.e2e.nvml import NvmlPeakPoller, NvmlUnavailable, nvml_unavailable_reason


def test_reason_or_device():
    reason = nvml_unavailable_reason()
    if reason is not None:
        assert reason.startswith("no NVML device")
        with pytest.raises(NvmlUnavailable, match="no NVML device"):
            NvmlPeakPoller().start()


def test_stop_before_start_and_bad_interval_are_errors():
    with pytest.raises(RuntimeError, match="before start"):
        NvmlPeakPoller().stop()
    with pytest.raises(ValueError, match="interval_s"):
        NvmlPeakPoller(interval_s=0)


@pytest.mark.gpu
@pytest.mark.exclusive_gpu  # NVML reads the whole device's memory, another worker's too
def test_peak_follows_an_allocation_on_gpu():
    torch = pytest.importorskip("torch")
    # Earlier tests in the same process leave blocks in torch's caching allocator; a 1 GiB tensor
    # would be served from that cache and NVML would see no change. Return the cache first.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    poller = NvmlPeakPoller(devices=[torch.cuda.current_device()], interval_s=0.05).start()
    before = dict(poller.peak_mib)
    block = torch.empty(1024 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # 1 GiB
    torch.cuda.synchronize()
    time.sleep(0.5)
    peaks = poller.stop()
    del block
    device = torch.cuda.current_device()
    assert peaks[device] >= before[device] + 900, (before, peaks)
    assert poller.samples >= 3
