"""SIGTERM ends a pytest run as Ctrl-C (SIGINT) does, and neither signal cuts the run's last write.

pytest turns SIGINT into ``KeyboardInterrupt``: the session ends ``interrupted`` and the plugin
merges ``run.json``. A SIGTERM (``kill``, a CI job's timeout, tox after its SIGINT: tox sends
SIGINT, then SIGTERM 0.3 s later, then SIGKILL) would end the process at once and leave
``run.json`` ``running``. :class:`StopSignals` raises ``KeyboardInterrupt`` on the first SIGTERM,
and once the run is finishing (``finishing()``) it only notes further SIGINTs and SIGTERMs, so the
merge completes. A run killed outright (SIGKILL) is recovered by ``rlk merge``.
"""
from __future__ import annotations

import signal
import threading


class StopSignals:
    def __init__(self) -> None:
        self.received: list[str] = []  # signal names, in the order they came
        self._finishing = False
        self._previous: dict[int, object] = {}

    def install(self) -> bool:
        """SIGTERM raises KeyboardInterrupt from now on (main thread only, and only where no one
        else handles SIGTERM); False when it left the handler alone."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return False
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
        return True

    def finishing(self) -> None:
        """The run is being written: SIGINT and SIGTERM are noted, not raised, until ``restore``."""
        if self._finishing or threading.current_thread() is not threading.main_thread():
            return
        self._finishing = True
        self._previous.setdefault(signal.SIGINT, signal.signal(signal.SIGINT, self._handle))
        if signal.SIGTERM not in self._previous:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        """pytest's hook (this object is registered as a plugin): the session ends next."""
        self.finishing()

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.received.append(signal.Signals(signum).name)
        if not self._finishing:
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")
