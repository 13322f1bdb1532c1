"""Progress lines of long steps on the terminal (the ``rlk_progress`` fixture)."""
from __future__ import annotations

import contextlib
import time

import pytest

from pytest_rlk.state import STATE


class Progress:
    """Progress lines of a long step on the terminal (through pytest's terminal reporter, with
    capture suspended for the line), so a minute of vLLM start-up or a TRL A/B is not silence:
    ``rlk: <test>: <message>``. Silent under ``-qq`` and in xdist workers (no terminal)."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config

    def __call__(self, message: str) -> None:
        config = self._config
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or config.get_verbosity() < -1 or hasattr(config, "workerinput"):
            return
        current = config.stash[STATE].current_test
        where = f"{current.split('::', 1)[-1]}: " if current else ""
        capture = config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            writer = getattr(reporter, "_tw", None)  # under -q the progress dots leave the line open
            if writer is not None and writer.width_of_current_line:
                reporter.write("\n")
            reporter.ensure_newline()
            reporter.write_line(f"rlk: {where}{message}")

    @contextlib.contextmanager
    def step(self, message: str):
        """``with rlk_progress.step("vLLM: start the engine, generate"):`` a line when it starts,
        one when it ends, with its duration (or that it failed)."""
        start = time.monotonic()
        self(f"{message} ...")
        try:
            yield
        except BaseException:
            self(f"{message}: failed after {time.monotonic() - start:.0f} s")
            raise
        self(f"{message}: done in {time.monotonic() - start:.0f} s")
