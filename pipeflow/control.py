"""The control channel: MPI's COMM_WORLD for the runtime's few agreements between ranks (issue 12).

The runtime holds COMM_WORLD (`world_comm`) and calls its plain methods (Get_rank, allgather, bcast,
gather, Barrier, Abort, isend) itself; what needs names from mpi4py (MAX, ANY_SOURCE, Status, the thread
level) lives here, so that this module and pipeflow.comm (the point-to-point channels and process groups
of torch.distributed) are the only ones that import a communication library. Every import of mpi4py is
lazy: the first one initialises MPI, and pipeflow-train's usage errors come before it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# Every MPI tag the runtime uses on COMM_WORLD, in one place, so that no two uses share one. Messages of
# one (source, tag) arrive in order; the receivers of these never use ANY_TAG.
META_TAG = 71            # comm.P2P: the shapes and dtypes of a channel's tensors, once per input shape
HEARTBEAT_TAG = 0x7E57   # watchdog: peer heartbeats
STOP_TAG = 0x7E58        # interrupt: a signalled rank tells the others


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
    comm.Allreduce(mine, every, op=MPI.MAX)
    return every


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
