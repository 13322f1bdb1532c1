"""The vime adapter's telemetry (kernels/integrations/vime.py's module docstring): the stage timer,
the backend id encoded in a metric's key, and the rlk_* values added to each call's metrics, each a
0-dim fp32 tensor on the loss's device, weighted by the call's share of vime's denominator.
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch

BACKEND_METRIC_PREFIX = "rlk_backend__"
STAGE_METRICS = ("rlk_logp_ms", "rlk_entropy_ms", "rlk_ratio_kl_ms", "rlk_loss_ms")


class StageTimer:
    """Time of named stages without a host sync: the device's own clock on a GPU
    (kernels/device_clock.py: each result a 0-dim fp32 tensor on the device, read whenever the
    training loop reads its metrics), ``time.perf_counter`` on a CPU (floats). ``stages``: how many
    stages it times at most."""

    def __init__(self, device: torch.device, stages: int = len(STAGE_METRICS)) -> None:
        self._clock = None
        if device.type == "cuda":
            from kernels.device_clock import DeviceClock  # Triton: imported where a GPU is timed

            self._clock = DeviceClock(device, 2 * stages)
        self._stamps = 0
        self._marks: list[tuple[str, Any, Any]] = []

    def stage(self, name: str) -> _Stage:
        return _Stage(self, name)

    def _now(self) -> Any:
        if self._clock is None:
            return time.perf_counter()
        slot, self._stamps = self._stamps, self._stamps + 1
        self._clock.stamp(slot)
        return slot

    def results_ms(self) -> dict[str, Any]:
        if self._clock is None:
            return {name: (end - start) * 1e3 for name, start, end in self._marks}
        return {name: self._clock.elapsed_ms(start, end) for name, start, end in self._marks}


class _Stage:
    def __init__(self, timer: StageTimer, name: str) -> None:
        self._timer, self._name = timer, name

    def __enter__(self) -> None:
        self._start = self._timer._now()

    def __exit__(self, *exc: object) -> None:
        self._timer._marks.append((self._name, self._start, self._timer._now()))


def backend_metric_name(backend_id: str) -> str:
    """``rlk_backend__<id>`` with characters outside [A-Za-z0-9_.-] replaced by '_'."""
    return BACKEND_METRIC_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", backend_id)


def backend_from_metrics(metrics: dict[str, Any]) -> str | None:
    """The (sanitized) backend id encoded in a metrics dict, with or without vime's ``train/`` prefix."""
    for key in metrics:
        name = key.rsplit("/", 1)[-1]
        if name.startswith(BACKEND_METRIC_PREFIX):
            return name[len(BACKEND_METRIC_PREFIX):]
    return None


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim fp32 tensor on ``device`` filled there (``torch.tensor(value, device=...)`` would copy
    it from the host and wait for the device)."""
    return torch.full((), value, dtype=torch.float32, device=device)


def _telemetry(metrics: dict, *, fell_back: bool, backend: str, stages_ms: dict[str, Any],
               weight: float | torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """``metrics`` and the rlk_* telemetry, every value a 0-dim fp32 tensor on ``device``; stage
    times are StageTimer's results (device tensors on a GPU, floats on a CPU), ``weight``
    call_weight's (a float, or a device tensor)."""
    def weighted(value: float | torch.Tensor) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) and not isinstance(weight, torch.Tensor):
            return _scalar(value * weight, device)
        return (value * weight).to(device=device, dtype=torch.float32)

    out = dict(metrics)
    out["rlk_fallback"] = weighted(float(fell_back))
    out[backend_metric_name(backend)] = weighted(1.0)
    for name in STAGE_METRICS:
        out[name] = weighted(stages_ms.get(name, 0.0))
    return out
