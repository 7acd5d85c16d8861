"""The control channel (pipeflow/control.py) in one process, on MPI's COMM_SELF: the operations the
watchdog, the stop thread, the step guard and the supervisor now reach MPI through (issue 12)."""
from __future__ import annotations

import time

import numpy as np


def test_allreduce_max_is_the_elementwise_maximum_and_leaves_the_input_alone():
    from mpi4py import MPI

    from pipeflow.control import allreduce_max

    mine = np.array([0, 3, 1], dtype=np.int64)
    every = allreduce_max(MPI.COMM_SELF, mine)
    assert every.dtype == np.int64 and every is not mine
    assert every.tolist() == [0, 3, 1] and mine.tolist() == [0, 3, 1]


def test_inbox_polls_one_tag_from_any_rank_and_takes_in_order():
    from mpi4py import MPI

    from pipeflow.control import Inbox, thread_multiple, world_comm

    comm = MPI.COMM_SELF
    inbox = Inbox(comm, tag=0x7E59)
    assert inbox.poll() is False
    other = comm.isend("other tag", dest=0, tag=0x7E5A)  # not this inbox's tag: never seen by it
    reqs = [comm.isend(k, dest=0, tag=0x7E59) for k in (7, 8)]
    got, deadline = [], time.monotonic() + 10.0
    while len(got) < 2 and time.monotonic() < deadline:  # a message may take a moment to arrive
        if inbox.poll():
            assert inbox.source == 0
            got.append(inbox.take())
    assert got == [7, 8] and inbox.poll() is False  # MPI keeps messages of one (source, tag) in order
    for r in reqs:
        r.wait()
    assert comm.recv(source=0, tag=0x7E5A) == "other tag"
    other.wait()
    assert world_comm() is MPI.COMM_WORLD
    assert thread_multiple() == (MPI.Query_thread() >= MPI.THREAD_MULTIPLE)


def test_control_is_one_typed_object_for_agreement_broadcast_and_gather():
    from types import SimpleNamespace

    from mpi4py import MPI

    from pipeflow.control import Control, Inbox

    c = Control.of(SimpleNamespace(mpi=MPI.COMM_SELF))  # as from a comm.World
    assert Control(c).comm is MPI.COMM_SELF and Control.world().comm is MPI.COMM_WORLD
    assert (c.rank, c.size) == (0, 1) and c.Get_rank() == 0  # other names are the communicator's
    assert c.agree(None) is None and c.agree("disk full") == "disk full"
    assert c.allgather("x") == ["x"] and c.bcast({"a": 1}) == {"a": 1} and c.gather(5) == [5]
    assert c.allreduce_max(np.array([2, 1], dtype=np.int64)).tolist() == [2, 1]
    assert isinstance(c.inbox(0x7E5B), Inbox) and c.inbox(0x7E5B).poll() is False
    c.barrier()
