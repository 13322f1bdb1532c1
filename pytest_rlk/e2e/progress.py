"""Progress of an A/B run on a terminal or in a CI log: plain lines, one per event.

Arms may run at the same time, so every line names its arm; lines are whole (no carriage-return
bars), which reads the same in a terminal and in a CI log. The arm's full output still goes to its
`arm.log` only.

    [trl+kernels] started (live lane), log /tmp/ab/live/kernels/arm.log
    [trl+kernels] rollout 3/16: raw_reward 0.094, train_rollout_logprob_abs_diff 1.2e-07, step_time_s 5.1
    [trl+kernels] succeeded in 92.4 s
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Protocol, TextIO

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.engine import StepProgress

# The metrics a progress line shows, when the step reports them.
KEY_METRICS = (m.RAW_REWARD, m.ABS_DIFF, m.KL_LOSS, m.STEP_TIME)


class Progress(Protocol):
    def message(self, text: str) -> None: ...

    def arm_started(self, arm: str, lane: str, log_path: Path) -> None: ...

    def step(self, arm: str, step: StepProgress, total: int) -> None: ...

    def arm_finished(self, arm: str, status: str, seconds: float) -> None: ...


class SilentProgress:
    """For library calls and tests: nothing is shown."""

    def message(self, text: str) -> None:
        pass

    def arm_started(self, arm: str, lane: str, log_path: Path) -> None:
        pass

    def step(self, arm: str, step: StepProgress, total: int) -> None:
        pass

    def arm_finished(self, arm: str, status: str, seconds: float) -> None:
        pass


def step_line(step: StepProgress, total: int) -> str:
    shown = [f"{name} {step.metrics[name]:.4g}" for name in KEY_METRICS if name in step.metrics]
    return f"rollout {step.index + 1}/{total}" + (": " + ", ".join(shown) if shown else "")


class LineProgress:
    """Plain lines to `stream` (default stderr, so stdout keeps the verdict and the report path)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def _write(self, text: str) -> None:
        stream = self.stream or sys.stderr
        with self._lock:
            stream.write(text + "\n")
            stream.flush()

    def message(self, text: str) -> None:
        self._write(text)

    def arm_started(self, arm: str, lane: str, log_path: Path) -> None:
        self._write(f"[{arm}] started ({lane} lane), log {log_path}")

    def step(self, arm: str, step: StepProgress, total: int) -> None:
        self._write(f"[{arm}] {step_line(step, total)}")

    def arm_finished(self, arm: str, status: str, seconds: float) -> None:
        self._write(f"[{arm}] {status} in {seconds:.1f} s")
