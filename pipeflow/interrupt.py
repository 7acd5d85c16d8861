"""Signals during an asynchronous run without --checkpoint-dir: the job ends at once, in one line."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from pipeflow.control import STOP_TAG  # the MPI tag on COMM_WORLD: a signalled rank tells the others
from pipeflow.failure import say
from pipeflow.signals import SignalStop


class ImmediateStop:
    """SIGTERM / SIGINT for the asynchronous schedules without --checkpoint-dir: they have no step
    boundary to stop at, and nothing is saved, so the job ends at once with one line and 128+N.

    Python runs signal handlers on the main thread only, between bytecodes, and that thread may be
    blocked in a gloo transfer: the handler's wakeup fd (written by the C-level handler) wakes a
    thread here instead. The signalled rank tells every other rank (MPI, STOP_TAG; a kill of one
    rank must end all), rank 0 prints the line, and each process leaves through os._exit: unwinding
    a thread blocked in a transfer is what gave tracebacks and a segfault (issue 11).
    """

    def __init__(self, comm: Any, progress: Any) -> None:
        from pipeflow.control import thread_multiple

        self.comm, self.progress = comm, progress  # progress(): steps this rank has finished
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.mpi_ok = self.size > 1 and thread_multiple()
        self._old: dict[int, Any] = {}
        self._old_fd: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def install(self) -> ImmediateStop:
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for s in SignalStop.SIGNALS:
            self._old[s] = signal.signal(s, self._handle)
        self._thread = threading.Thread(target=self._loop, name="pipeflow-signals", daemon=True)
        self._thread.start()
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler: the wakeup fd has already told the thread."""

    def _loop(self) -> None:
        import select

        from pipeflow.control import Inbox

        assert self._pipe is not None
        inbox = Inbox(self.comm, STOP_TAG)
        while not self._done.is_set():
            ready, _, _ = select.select([self._pipe[0]], [], [], 0.1)
            if ready:
                data = os.read(self._pipe[0], 16)
                if not data or self._done.is_set():
                    return
                self._stop(data[0], self.rank)
            if self.mpi_ok and inbox.poll():
                signum = inbox.take()
                self._stop(int(signum), inbox.source)

    def _stop(self, signum: int, by: int) -> None:
        if by == self.rank and self.mpi_ok:  # tell the others; small messages complete at once
            reqs = [self.comm.isend(signum, dest=p, tag=STOP_TAG) for p in range(self.size) if p != self.rank]
            deadline = time.monotonic() + 1.0
            while reqs and time.monotonic() < deadline:
                reqs = [q for q in reqs if not q.Test()]
                time.sleep(0.01)
        if self.rank == 0:
            name = signal.Signals(signum).name
            say(f"pipeflow-train: stopped by {name} (received by rank {by}) during step {self.progress() + 1}; "
                "nothing saved: the asynchronous schedules checkpoint only with --checkpoint-dir")
        else:  # rank 0 speaks; mpirun ends the job when it exits (if it cannot, leave on our own)
            time.sleep(2.0)
        sys.stderr.flush()
        os._exit(128 + signum)

    def restore(self) -> None:
        self._done.set()
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(-1 if self._old_fd is None else self._old_fd)
            os.close(self._pipe[1])  # wakes the thread: it reads EOF and ends
            if self._thread is not None:
                self._thread.join()
            os.close(self._pipe[0])
            self._pipe = None
