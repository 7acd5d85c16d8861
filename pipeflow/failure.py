"""How a run ends on failure: exit codes, the exceptions every rank stops with, and one-line reports.

The mechanisms live beside it, one idea each: watchdog.py (peer heartbeats, MPI Abort), signals.py
(SIGTERM/SIGINT stop at a step boundary), guard.py (non-finite checks at STEP) and supervisor.py (resume,
checkpoints and stops at step boundaries).
"""
from __future__ import annotations

import os
import sys

EXIT_FAILED = 3         # a peer died or stopped responding
EXIT_NONFINITE = 4      # a non-finite loss or gradient without --skip-nonfinite


class StopTraining(Exception):
    """Raised at a step boundary that every rank agreed to stop at (signal or non-finite values)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def say(text: str) -> None:
    """One line on stderr, now, in one write: the process may be aborted right after, and under
    PYTHONUNBUFFERED=1 print() writes the text and its newline separately, so that lines of
    several ranks sharing mpirun's stderr could merge."""
    sys.stderr.flush()
    os.write(2, (text.rstrip("\n") + "\n").encode())


class NonFiniteError(RuntimeError):
    """A non-finite update on one rank of an asynchronous schedule, which has no common step boundary."""


class AgreedError(Exception):
    """An error every rank raises together (after Control.agree): reported on every rank, exit 2, no Abort."""


class UsageError(ValueError):
    """A flag, file or world size that cannot work; reported once (rank 0) when all ranks agree, exit code 2."""
