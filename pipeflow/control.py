"""The control channel: MPI's COMM_WORLD for the runtime's few agreements between ranks (issue 12).

`Control` is the channel as one typed object (made from the World's communicator, or COMM_WORLD before the
World exists): agreement on errors, broadcast, gather, an element-wise maximum, a barrier, the abort, and
polled messages of one tag (Inbox). What needs names from mpi4py (MAX, ANY_SOURCE, Status, the thread
level) lives here, so that this module and pipeflow.comm (the point-to-point channels and process groups
of torch.distributed) are the only ones that import a communication library. Every import of mpi4py is
lazy: the first one initialises MPI, and pipeflow-train's usage errors come before it.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# Every MPI tag the runtime uses on COMM_WORLD, in one place, so that no two uses share one. Messages of
# one (source, tag) arrive in order; the receivers of these never use ANY_TAG.
META_TAG = 71            # comm.P2P: the shapes and dtypes of a channel's tensors, once per input shape
RING_TAGS = {"F": 72, "B": 73, "R": 74}  # celink: a sender's new ring of slots, per direction of a channel ("R": the
#                                          replicas' gradient sum on the copy engines, celink.PairSum)
HEARTBEAT_TAG = 0x7E57   # watchdog: peer heartbeats
STOP_TAG = 0x7E58        # interrupt: a signalled rank tells the others
OPTIMIZER_STATE_TAG = 0x5A4  # checkpoint: a sharded stage's optimizer state, each replica's to replica 0

# MPICH's mpirun drops the output a rank wrote just before MPI Abort in about 1 run of 6 (a 3-rank job,
# idle 2-core machine; 0 of 80 with a 0.2 s pause): the abort overtakes the forwarded stderr. The pause
# lets the rank's last line reach the user.
ABORT_GRACE_S = 0.5
# MPI Abort ends the job through the launcher. Where it does not, the rank ends itself (`abort_comm`), and mpirun,
# seeing a rank exit with a failure, ends the others.
ABORT_STUCK_S = 20


def abort_comm(comm: Any, code: int) -> None:
    """MPI Abort on `comm` with exit code `code`, after the rank's pending output has had time to reach mpirun;
    this process never returns from it. MPI Abort itself may: with mpirun gone (killed), the abort's message to
    it fails and the call returns, and the rank exits with `code` at once (it used to go on, its watchdog writing
    its error line again and again until the pipe nobody read was full). Or it may not end: once in about twenty
    loaded runs of the test suite a rank slept inside MPI Abort for the whole test timeout. An alarm set first
    ends the process ABORT_STUCK_S later, with no Python code needed to run for it (SIGALRM's default action)."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    if hasattr(signal, "alarm"):  # any thread may set it (the watchdog's aborts from its own)
        signal.alarm(ABORT_STUCK_S)
    comm.Abort(code)
    os._exit(code)


class Control:
    """The control channel over one MPI communicator: the collectives every rank calls together, in the
    same order, and a rank's own abort. Modules written against a plain mpi4py communicator (Get_rank,
    isend, Dup, ...) may be given a Control: other attributes are the communicator's."""

    def __init__(self, comm: Any) -> None:
        self.comm: Any = comm.comm if isinstance(comm, Control) else comm

    @classmethod
    def world(cls) -> Control:
        """COMM_WORLD's channel (MPI is initialised by the first call)."""
        return cls(world_comm())

    @classmethod
    def of(cls, world: Any) -> Control:
        """The channel of a comm.World (its `mpi` communicator)."""
        return cls(world.mpi)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    @property
    def rank(self) -> int:
        return int(self.comm.Get_rank())

    @property
    def size(self) -> int:
        return int(self.comm.Get_size())

    def agree(self, error: str | None) -> str | None:
        """Share an error that may have happened on some ranks only: every rank gets the first one
        (prefixed with its rank when it happened elsewhere), or None when all succeeded."""
        errors = self.allgather(error)
        if not any(errors):
            return None
        first = next(r for r, e in enumerate(errors) if e)
        return error or f"rank {first}: {errors[first]}"

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        arrive(self.comm)
        return list(self.comm.allgather(obj))

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """`root`'s `obj` on every rank."""
        arrive(self.comm)
        return self.comm.bcast(obj, root=root)

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's `obj` in rank order on `root`; None elsewhere."""
        arrive(self.comm)
        got = self.comm.gather(obj, root=root)
        return list(got) if got is not None else None

    def allreduce_max(self, mine: np.ndarray) -> np.ndarray:
        """The element-wise maximum of `mine` over every rank."""
        return allreduce_max(self.comm, mine)

    def barrier(self) -> None:
        arrive(self.comm)

    Barrier = barrier  # mpi4py's name, for modules written against a communicator

    def recv(self, *, source: int, tag: int) -> Any:
        """The next message of `tag` from `source`, waited for without spinning a core (`quiet_wait`)."""
        quiet_wait(lambda: bool(self.comm.iprobe(source=source, tag=tag)))
        return self.comm.recv(source=source, tag=tag)

    def abort(self, code: int) -> None:
        """End every rank of the job with exit code `code` (MPI Abort): for errors the ranks cannot agree on."""
        abort_comm(self.comm, code)

    def inbox(self, tag: int) -> Inbox:
        """The messages of `tag` from any rank, polled without blocking."""
        return Inbox(self.comm, tag)


def world_comm() -> Any:
    """mpi4py's COMM_WORLD; MPI is initialised once per process, by the first import."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def thread_multiple() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE (mpi4py's default), which the watchdog and the stop
    thread need to call MPI beside the main thread."""
    from mpi4py import MPI

    return bool(MPI.Query_thread() >= MPI.THREAD_MULTIPLE)


def allreduce_max(comm: Any, mine: np.ndarray) -> np.ndarray:
    """The element-wise maximum of `mine` over every rank of `comm` (one MPI Allreduce, all ranks call it)."""
    from mpi4py import MPI

    every = np.empty_like(mine)
    quiet_wait(comm.Iallreduce(mine, every, op=MPI.MAX).Test)
    return every


# MPICH's blocking calls wait by polling: a rank waiting in MPI_Recv keeps a core 100% busy (MPI_Barrier about a
# third of one), whatever MPIR_CVAR_ENABLE_HEAVY_YIELD says. Ranks wait there for the slowest rank at every step's
# agreement and for a peer's first message, so on a host with fewer free cores than ranks (CPU training, the test
# machine's 2 cores) the waiting ranks took the CPU from the one they waited for. `quiet_wait` polls the request
# instead, sleeping between polls: QUIET_SPIN_S of plain polling (a peer that is nearly there costs no sleep), then
# sleeps growing to QUIET_MAX_SLEEP_S, the most it can add to a wait.
QUIET_SPIN_S = 50e-6
QUIET_MAX_SLEEP_S = 500e-6


def quiet_wait(done: Callable[[], bool]) -> None:
    """Return once `done()` (an MPI request's Test) is true, polling it without keeping a core busy."""
    start = time.perf_counter()
    pause = 10e-6
    while not done():
        if time.perf_counter() - start > QUIET_SPIN_S:
            time.sleep(pause)
            pause = min(pause * 2, QUIET_MAX_SLEEP_S)


def arrive(comm: Any) -> None:
    """A barrier on `comm`, waited for quietly (`quiet_wait`): before a blocking collective, so that it only
    runs once every rank is there."""
    quiet_wait(comm.Ibarrier().Test)


class Inbox:
    """The messages of one tag from any rank, polled without blocking (heartbeats, stop messages)."""

    def __init__(self, comm: Any, tag: int) -> None:
        from mpi4py import MPI

        self.comm, self.tag = comm, tag
        self.any_source = MPI.ANY_SOURCE
        self.status = MPI.Status()

    def poll(self) -> bool:
        """Whether a message waits; its sender is then `source`, and `take` receives it."""
        return bool(self.comm.iprobe(source=self.any_source, tag=self.tag, status=self.status))

    @property
    def source(self) -> int:
        """The sender of the message the last poll found."""
        return int(self.status.Get_source())

    def take(self) -> Any:
        """Receive the message the last poll found."""
        return self.comm.recv(source=self.source, tag=self.tag)
