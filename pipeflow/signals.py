"""SIGTERM / SIGINT during training: a flag that the step boundary shares with all ranks."""
from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("pipeflow.failure")  # the name these lines had before failure.py was split: log lines unchanged


class SignalStop:
    """SIGTERM / SIGINT set a flag that the step boundary shares with all ranks; a second signal of
    the same kind ends the process at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}

    def install(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum == signum:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum
        log.info("got %s: stopping at the next step boundary (send it again to stop at once)",
                 signal.Signals(signum).name)

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
