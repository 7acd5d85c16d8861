"""Peer heartbeats: a rank that dies or stops (SIGSTOP, a hung host) ends the job within --timeout."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from pipeflow.control import HEARTBEAT_TAG, abort_comm  # HEARTBEAT_TAG: the watchdog's MPI tag on COMM_WORLD
from pipeflow.failure import EXIT_FAILED, say

log = logging.getLogger("pipeflow.failure")  # the name these lines had before failure.py was split: log lines unchanged

ALL_TO_ALL_MAX = 16     # up to this many ranks every rank watches every other; beyond, ring neighbours


def write_pid_file() -> None:
    """Tests find a rank's process through $PIPEFLOW_PID_DIR/rank<N>.pid (hidden; unset in normal runs)."""
    d = os.environ.get("PIPEFLOW_PID_DIR")
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
    if d:
        with open(os.path.join(d, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))


class Watchdog:
    """Heartbeats between ranks from a daemon thread, on COMM_WORLD under HEARTBEAT_TAG.

    A rank that dies or is stopped (SIGSTOP, a hung host) stops sending; its watchers print which
    rank went silent and call MPI Abort after `timeout_s`, so blocking MPI calls on the main thread
    (collectives at step boundaries, shape messages, gathers) never wait forever. A rank busy in a
    long computation keeps beating: the thread runs while torch and MPI release the GIL.
    Needs MPI_THREAD_MULTIPLE (mpi4py's default); otherwise it is off, with a warning.
    """

    def __init__(self, comm: Any, timeout_s: float) -> None:
        from pipeflow.control import thread_multiple

        self.comm, self.timeout = comm, timeout_s
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.interval = min(1.0, timeout_s / 8)
        if self.size <= ALL_TO_ALL_MAX:
            peers = set(range(self.size))
        else:
            peers = {(self.rank - 1) % self.size, (self.rank + 1) % self.size}
        self.peers = sorted(peers - {self.rank})
        self.last_seen = {p: time.monotonic() for p in self.peers}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sends: list[Any] = []
        self.checks: list[Any] = []  # callables returning (peer, why) when a transfer from it stalled (watch)
        if self.peers and not thread_multiple():
            log.warning("MPI is not initialised with MPI_THREAD_MULTIPLE: dead or stopped ranks are not "
                        "detected on MPI calls (gloo transfers still time out after --timeout)")
            self.peers = []

    def watch(self, check: Any) -> None:
        """Also call `check()` from the thread at every poll; a (peer, why) it returns ends the job as a silent
        peer does (the copy-engine transfers, which have no timeout of their own: celink.CopyEngines.stalled)."""
        self.checks.append(check)

    def start(self) -> Watchdog:
        if self.peers:
            self._thread = threading.Thread(target=self._loop, name="pipeflow-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self, *, sync: bool = False) -> None:
        """Stop beating and watching, before MPI finalises. `sync` (all ranks call it together): a
        barrier after the thread ended, so that no rank beats at a peer that has finalised."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            for r in self._sends:
                r.Wait()
            self._sends = []
            if sync:  # twice: a beat sent just before a peer's barrier may land after ours
                for _ in range(2):
                    self.comm.Barrier()
                    self._drain()

    def _drain(self) -> None:
        """Receive the heartbeats still queued: MPI_Finalize with unmatched messages can end badly."""
        from pipeflow.control import Inbox

        inbox = Inbox(self.comm, HEARTBEAT_TAG)
        while inbox.poll():
            inbox.take()

    def _loop(self) -> None:
        from pipeflow.control import Inbox

        inbox = Inbox(self.comm, HEARTBEAT_TAG)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._sends = [r for r in self._sends if not self._test(r)]
                for p in self.peers:
                    try:
                        self._sends.append(self.comm.isend(None, dest=p, tag=HEARTBEAT_TAG))
                    except Exception as e:  # MPI reports a dead peer when jobs keep running on errors
                        self._fail(p, f"sending to it failed ({e})")
                next_beat = now + self.interval
            try:
                while inbox.poll():
                    src = inbox.source
                    inbox.take()
                    self.last_seen[src] = time.monotonic()
            except Exception as e:
                self._fail(inbox.source, f"receiving from it failed ({e})")
            now = time.monotonic()
            silent = [(p, now - t) for p, t in self.last_seen.items() if now - t > self.timeout]
            if silent:
                p, age = max(silent, key=lambda x: x[1])
                self._fail(p, f"no heartbeat for {age:.1f} s (--timeout {self.timeout:g}); it died or is stopped")
            self._check_transfers()
            self._stop.wait(self.interval / 4)

    def _check_transfers(self) -> None:
        for check in list(self.checks):
            try:
                stalled = check()
            except Exception as e:  # a failing check must not end the heartbeats: it is dropped, once, with a line
                log.warning("a transfer check failed and is no longer run: %s", e)
                self.checks.remove(check)
                continue
            if stalled is not None:
                self._fail(*stalled)

    def _test(self, request: Any) -> bool:
        try:
            return bool(request.Test())
        except Exception:
            return True  # a failed send: the receiving side is judged by its own heartbeats

    def _fail(self, peer: int, why: str) -> None:
        if self._stop.is_set():
            return
        say(f"pipeflow-train: error: [rank {self.rank}] rank {peer} stopped responding: {why}. Stopping all ranks.")
        abort_comm(self.comm, EXIT_FAILED)

    def suspects(self, wait_s: float | None = None) -> list[int]:
        """Peers silent for more than three beats, waiting up to `wait_s` for one to show up: after a
        transfer failed, this names the rank behind it."""
        if self._thread is None:
            return []
        deadline = time.monotonic() + (4 * self.interval if wait_s is None else wait_s)
        while True:
            now = time.monotonic()
            out = sorted(p for p, t in self.last_seen.items() if now - t > 3 * self.interval)
            if out or now >= deadline:
                return out
            time.sleep(self.interval / 4)
