"""NVML poller: peak used memory per GPU while an arm runs (vime logs no peak-memory metric).

Uses `pynvml` (the `nvidia-ml-py` package). Memory is NVML's `used` per device, sampled every
`interval_s` in a background thread, so it covers every process on the GPU (Ray workers, vLLM),
which is what a job costs; run A/B arms one after the other on otherwise idle GPUs.

On a machine without a driver or GPU, `start()` raises `NvmlUnavailable("no NVML device: ...")`;
`nvml_unavailable_reason()` returns that reason without raising.
"""

from __future__ import annotations

import threading

MIB = 1024 * 1024


class NvmlUnavailable(RuntimeError):
    """NVML cannot report memory here (no driver, no device, or pynvml missing)."""


def _nvml():
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable(f"no NVML device: pynvml is not installed ({exc}); pip install nvidia-ml-py") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"no NVML device: nvmlInit failed ({exc})") from None
    return pynvml


def nvml_unavailable_reason() -> str | None:
    """None when NVML sees at least one GPU, else the reason."""
    try:
        nvml = _nvml()
    except NvmlUnavailable as exc:
        return str(exc)
    try:
        if nvml.nvmlDeviceGetCount() == 0:
            return "no NVML device: the driver reports 0 GPUs"
    finally:
        nvml.nvmlShutdown()
    return None


class NvmlPeakPoller:
    """Samples used memory of `devices` (default: all) from `start()` until `stop()`."""

    def __init__(self, devices: list[int] | None = None, interval_s: float = 0.5) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._requested = devices
        self.interval_s = interval_s
        self.peak_mib: dict[int, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> NvmlPeakPoller:
        nvml = _nvml()
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            nvml.nvmlShutdown()
            raise NvmlUnavailable("no NVML device: the driver reports 0 GPUs")
        devices = list(range(count)) if self._requested is None else list(self._requested)
        bad = [d for d in devices if not 0 <= d < count]
        if bad:
            nvml.nvmlShutdown()
            raise NvmlUnavailable(f"NVML devices {bad} do not exist (the driver reports {count})")
        handles = {d: nvml.nvmlDeviceGetHandleByIndex(d) for d in devices}
        self.peak_mib = {d: 0.0 for d in devices}
        self._sample(nvml, handles)
        self._thread = threading.Thread(target=self._loop, args=(nvml, handles), daemon=True,
                                        name="rlk-nvml-poller")
        self._thread.start()
        return self

    def _sample(self, nvml, handles) -> None:
        for device, handle in handles.items():
            used = nvml.nvmlDeviceGetMemoryInfo(handle).used / MIB
            if used > self.peak_mib[device]:
                self.peak_mib[device] = used
        self.samples += 1

    def _loop(self, nvml, handles) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self._sample(nvml, handles)
            self._sample(nvml, handles)
        except BaseException as exc:  # surfaced by stop(): a poller that dies must not pass silently
            self._error = exc
        finally:
            nvml.nvmlShutdown()

    def stop(self) -> dict[int, float]:
        """Stop sampling; returns peak MiB per device. Raises if the sampling thread failed."""
        if self._thread is None:
            raise RuntimeError("NvmlPeakPoller.stop() before start()")
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise NvmlUnavailable(f"NVML polling failed: {self._error}") from self._error
        return dict(self.peak_mib)
