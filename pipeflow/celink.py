"""Point-to-point channels between stages on the GPUs' copy engines: no kernel waits for a transfer.

For stages on one host whose GPUs are peers (NVLink or PCIe peer access), so that compute keeps every SM.

Why: a posted NCCL receive is a kernel resident on the receiving GPU until the data arrives, and the compute
beside it ran 16-30% slower on 2 x H200 (benchmarks/gpu/bench_peer.py); the same wait done as a stream memory
operation cost 0-2%. The protocol (as vLLM's copy-engine pipeline transport), per channel (sender, receiver,
direction), message n counted alike on both sides:

  sender, on its channel stream: wait for the producing compute; once the receiver has pulled message n - SLOTS
  (its `empty` flag, on the sender's GPU, >= n - SLOTS + 1), copy the tensors into slot n % SLOTS of its own ring;
  raise the receiver's `full` flag to n + 1.
  receiver, on its channel stream: wait until `full` >= n + 1, pull the slot over the copy engines into its
  receive buffers, raise the sender's `empty` to n + 1; the compute stream waits for that pull at the data's use.

Flags are 32-bit counters written with cuStreamWriteValue32 across the peer mapping and waited on with
cuStreamWaitValue32; neither an SM nor a host thread waits. Rings live on the sender and grow when a message is
larger than a slot: the sender then maps a new ring and tells the receiver over MPI (tagged by direction). The
receiver knows each message's size from its shapes, so it knows when to read such a message; it reads it at
the receive's post if the sender has sent it, else at the data's use (as receives.py defers unknown shapes)."""
from __future__ import annotations

import logging
import pickle
import threading
import time
from collections import deque
from typing import Any, Protocol

import torch

from pipeflow import cudadrv
from pipeflow.control import RING_TAGS

log = logging.getLogger(__name__)
cuda: Any = torch.cuda  # streams and events (tests/test_celink.py replays the protocol on fakes)

SLOTS = 4  # messages a channel holds before its sender's stream waits for the receiver's pulls
ALIGN = 256
Key = tuple[int, int, str]  # (sender, receiver, "F" | "B" | "R")


class Rank(Protocol):
    """What the copy engines read of this process's place in the job (comm.World has it)."""

    rank: int
    local_rank: int
    device: torch.device
    mpi: Any  # mpi4py's COMM_WORLD: the ring messages and the set-up's agreements


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of tensors of `sizes` bytes packed in one slot (each aligned), and the slot's bytes."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, max(end, ALIGN)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Work:
    """A send's or receive's completion on the GPU, like a torch.distributed work: wait() makes the current stream
    wait (the host never does); a receive whose ring is not known yet is posted at its wait (`post`)."""

    def __init__(self, event: torch.cuda.Event | None, keep: list[torch.Tensor], n: int = -1) -> None:
        self.event, self.keep, self.n = event, keep, n  # keep: the tensors; n: a receive's message on its channel
        self.post: Any = None
        self.layout = layout([_nbytes(b) for b in keep]) if n >= 0 else ([], 0)  # a receive's offsets and bytes

    def wait(self) -> None:
        if self.post is not None:
            self.post()
        assert self.event is not None
        cuda.current_stream().wait_event(self.event)

    def is_completed(self) -> bool:
        if self.event is None or not self.event.query():
            return False
        self.keep = []
        return True


class End:
    """One end of a channel: its stream, message count, and rings ((first message, address, slot bytes), newest
    last; the sender's own, the receiver's mapped)."""

    def __init__(self, key: Key, device: torch.device, mine: int, theirs: int) -> None:
        self.key, self.mine, self.theirs = key, mine, theirs  # my flag's address, the peer's flag mapped here
        self.stream = cuda.Stream(device)
        self.count = 0
        self.rings: list[tuple[int, int, int]] = []
        self.deferred: list[Work] = []  # receives waiting for a ring message, oldest first

    def holds(self, need: int) -> bool:
        """Whether the newest ring's slots hold a message of `need` bytes."""
        return bool(self.rings) and need <= self.rings[-1][2]

    def slot(self, n: int) -> int:
        """The address of message n's slot, in the ring that was newest when the sender sent it."""
        first, addr, size = next(r for r in reversed(self.rings) if r[0] <= n)
        return addr + (n % SLOTS) * size

    def move(self, pairs: list[tuple[int, int, int]], n: int) -> torch.cuda.Event:
        """On this end's stream: the copies (to, from, bytes), then the peer's flag raised to n + 1; the event of
        their end."""
        for dst, src, nbytes in pairs:
            if nbytes:
                cudadrv.copy(dst, src, nbytes, self.stream.cuda_stream)
        cudadrv.write(self.stream.cuda_stream, self.theirs, n + 1)
        ev = cuda.Event()
        ev.record(self.stream)
        return ev


class CopyEngines:
    """The copy-engine ends of this rank's channels (set up by `setup`, collectively)."""

    def __init__(self, world: Rank, ends: dict[Key, End], pages: list[int]) -> None:
        self.world, self.ends, self.pages = world, ends, pages
        self.ring_bytes = 0  # this rank's rings (its flags page aside)
        # receives posted on the GPU, oldest first (posted at, work, sender), for the watchdog's thread (stalled)
        self.posted: deque[tuple[float, Work, int]] = deque()
        self.lock = threading.Lock()

    def has(self, key: Key) -> bool:
        return key in self.ends

    def send(self, key: Key, bufs: list[torch.Tensor]) -> Work:
        end = self.ends[key]
        n = end.count
        end.count += 1
        offsets, need = layout([_nbytes(b) for b in bufs])
        if not end.holds(need):  # a new ring for messages n onwards; the old ones stay
            addr = cudadrv.alloc(SLOTS * need)
            self.pages.append(addr)
            self.ring_bytes += SLOTS * need
            end.rings.append((n, addr, need))
            self.world.mpi.send(pickle.dumps((n, cudadrv.ipc_handle(addr), need)), dest=key[1],
                                tag=RING_TAGS[key[2]])
        dst = end.slot(n)
        end.stream.wait_stream(cuda.current_stream())  # the tensors are computed
        if n >= SLOTS:
            cudadrv.wait_at_least(end.stream.cuda_stream, end.mine, n - SLOTS + 1)
        pairs = [(dst + off, b.data_ptr(), _nbytes(b)) for b, off in zip(bufs, offsets, strict=True)]
        return Work(end.move(pairs, n), bufs)

    def recv(self, key: Key, bufs: list[torch.Tensor], *, now: bool = False) -> Work:
        """A receive, posted at once where its ring is known, else at its wait; `now`: at once, waiting for the
        sender's ring message (PairSum: the sender has sent it, or is about to, at its own send of this message)."""
        end = self.ends[key]
        work = Work(None, bufs, end.count)
        end.count += 1
        if end.deferred or not self._known(end, work.layout[1]):
            work.post = lambda: self._post_deferred(end, work)
            end.deferred.append(work)
            if now:
                work.post()
        else:
            self._pull(end, work)
        return work

    def _known(self, end: End, need: int) -> bool:
        """Whether a ring holds messages of `need` bytes, reading the sender's ring messages already here (never
        waits for one)."""
        while not end.holds(need):
            if not self.world.mpi.Iprobe(source=end.key[0], tag=RING_TAGS[end.key[2]]):
                return False
            self._read_ring(end)
        return True

    def _read_ring(self, end: End) -> None:
        first, handle, slot = pickle.loads(self.world.mpi.recv(source=end.key[0], tag=RING_TAGS[end.key[2]]))
        addr = cudadrv.ipc_open(handle)
        self.pages.append(-addr)  # mapped, not owned: closed, not freed
        end.rings.append((first, addr, slot))

    def _post_deferred(self, end: End, upto: Work) -> None:
        """Post the deferred receives up to `upto`, in order, reading ring messages as they are needed."""
        while end.deferred and upto.event is None:
            w = end.deferred.pop(0)
            while not end.holds(w.layout[1]):
                self._read_ring(end)
            self._pull(end, w)

    def _pull(self, end: End, work: Work) -> None:
        """Post receive `work` (message work.n into the tensors work.keep) on the end's stream."""
        offsets, _ = work.layout
        src = end.slot(work.n)
        end.stream.wait_stream(cuda.current_stream())  # the buffers' memory is free on the compute stream's order
        cudadrv.wait_at_least(end.stream.cuda_stream, end.mine, work.n + 1)
        pairs = [(b.data_ptr(), src + off, _nbytes(b)) for b, off in zip(work.keep, offsets, strict=True)]
        work.event, work.post = end.move(pairs, work.n), None
        with self.lock:
            self._prune()
            self.posted.append((time.monotonic(), work, end.key[0]))

    def _prune(self) -> None:
        """Drop the arrived receives at the front of `posted` (under the lock)."""
        while self.posted and self.posted[0][1].is_completed():
            self.posted.popleft()

    def stalled(self, timeout_s: float) -> tuple[int, str] | None:
        """The sender of a receive posted more than `timeout_s` ago that has not arrived, and what to say; None
        if every older one arrived. NCCL's transfers time out; these wait on the GPU without limit, so the
        watchdog's thread asks this (a peer that is alive but never sends keeps its heartbeats)."""
        now = time.monotonic()
        if self.world.device.type == "cuda":  # this thread's current device, or a query makes a context on GPU 0
            cuda.set_device(self.world.device)
        with self.lock:
            self._prune()
            if not self.posted or now - self.posted[0][0] <= timeout_s:
                return None
            posted, _, peer = self.posted[0]
        return peer, (f"a tensor it sends on the copy engines has not arrived after {now - posted:.1f} s "
                      f"(--timeout {timeout_s:g})")

    def close(self) -> None:
        """Unmap the peers' memory and free this rank's (after the device is idle)."""
        cuda.synchronize()
        for addr in self.pages:
            (cudadrv.ipc_close if addr < 0 else cudadrv.free)(abs(addr))
        self.pages = []


class PairSum:
    """The replicas' all-reduce where they are two peer GPUs (PIPEFLOW_REDUCE=ce, reduce.GradReducer): each sends its
    tensor to the other on its channel (me, peer, "R") and adds the one it pulls, on the pulling channel's stream,
    so that no kernel waits for a transfer. NCCL's all-reduce, resident beside the last backward, made it 3% slower
    on 2 x H200 whatever its channels (benchmarks/gpu/README.md). a + b and b + a round alike: both replicas hold
    the same sum, the one NCCL's two-rank all-reduce gives."""

    def __init__(self, engines: CopyEngines, me: int, peer: int) -> None:
        self.engines, self.out, self.into = engines, (me, peer, "R"), (peer, me, "R")

    def __call__(self, t: torch.Tensor) -> Summed:
        return self.receive(t, self.send(t))

    def send(self, t: torch.Tensor) -> Work:
        return self.engines.send(self.out, [t])

    def receive(self, t: torch.Tensor, sent: Work) -> Summed:
        """The peer's tensor pulled and added to `t` (sent as `sent`). The pull is posted now, waiting on the host for
        the peer's ring message where it has not come yet: posted at the wait instead, it would come after whatever
        the host does first, while the peer's sends past SLOTS wait on the GPU for it. A device-wide sync in between
        (NCCL creating a communicator for the presence flags, reduce.py) then waited for them: both ranks hung."""
        buf = torch.empty_like(t)  # on the compute stream; the pull waits for it (CopyEngines._pull)
        got = self.engines.recv(self.into, [buf], now=True)
        return Summed(t, buf, sent, got, self.engines.ends[self.into].stream)


class Summed:
    """A PairSum in flight, like a torch.distributed work: wait() makes the current stream wait for the sum in
    place (the host never waits). The add is queued at once, after the pull (posted at its receive) on its stream."""

    def __init__(self, t: torch.Tensor, buf: torch.Tensor, sent: Work, got: Work, stream: Any) -> None:
        self.t, self.sent, self.got = t, sent, got
        assert sent.event is not None and got.event is not None
        stream.wait_event(sent.event)  # this tensor is copied out before it is added to
        add_on(stream, t, buf)  # after the pull, on its stream
        self.event = cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        cuda.current_stream().wait_event(self.event)


def add_on(stream: Any, t: torch.Tensor, buf: torch.Tensor) -> None:
    """t += buf on `stream`; buf is freed once that has run, not when the compute stream gets there."""
    with cuda.stream(stream):
        t.add_(buf)
    buf.record_stream(stream)
