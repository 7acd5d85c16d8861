"""Point-to-point channels on the GPUs' copy engines, for stages on one host whose GPUs are peers (NVLink or PCIe
peer access): no kernel waits for a transfer, so compute keeps every SM.

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
import os
import pickle
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from pipeflow import cudadrv
from pipeflow.control import RING_TAGS
from pipeflow.failure import UsageError

log = logging.getLogger(__name__)
_cuda: Any = torch.cuda  # streams and events (tests/test_celink.py replays the protocol on fakes)

SLOTS = 4  # messages a channel holds before its sender's stream waits for the receiver's pulls
ALIGN = 256
TRANSPORTS = ("auto", "nccl", "ce")
Key = tuple[int, int, str]  # (sender, receiver, "F" | "B")


def p2p_transport(environ: Mapping[str, str] = os.environ) -> str:
    """PIPEFLOW_P2P: auto (the copy engines where both GPUs of a channel are peers on one host, else NCCL),
    nccl, or ce (the copy engines, an error where a channel cannot use them). Default auto."""
    text = environ.get("PIPEFLOW_P2P", "auto")
    if text not in TRANSPORTS:
        raise ValueError(f"PIPEFLOW_P2P must be one of {', '.join(TRANSPORTS)}, found {text!r}")
    return text


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

    def __init__(self, event: torch.cuda.Event | None, keep: list[torch.Tensor], post: Any = None) -> None:
        self.event, self.keep, self.post = event, keep, post
        self.n, self.offsets, self.need = -1, [0], 0  # a deferred receive's message, layout and bytes

    def wait(self) -> None:
        if self.post is not None:
            self.post()
        assert self.event is not None
        _cuda.current_stream().wait_event(self.event)

    def is_completed(self) -> bool:
        if self.event is None or not self.event.query():
            return False
        self.keep = []
        return True


class _End:
    """One end of a channel: its stream, message count, and rings ((first message, address, slot bytes), newest
    last; the sender's own, the receiver's mapped)."""

    def __init__(self, key: Key, device: torch.device, mine: int, theirs: int) -> None:
        self.key, self.mine, self.theirs = key, mine, theirs  # my flag's address, the peer's flag mapped here
        self.stream = _cuda.Stream(device)
        self.count = 0
        self.rings: list[tuple[int, int, int]] = []
        self.deferred: list[Work] = []  # receives waiting for a ring message, oldest first

    def ring(self, n: int) -> tuple[int, int]:
        first, addr, slot = next(r for r in reversed(self.rings) if r[0] <= n)
        return addr, slot


class CopyEngines:
    """The copy-engine ends of this rank's channels (set up by `setup`, collectively)."""

    def __init__(self, world: Any, ends: dict[Key, _End], pages: list[int]) -> None:
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
        if not end.rings or need > end.rings[-1][2]:  # a new ring for messages n onwards; the old ones stay
            addr = cudadrv.alloc(SLOTS * need)
            self.pages.append(addr)
            self.ring_bytes += SLOTS * need
            end.rings.append((n, addr, need))
            self.world.mpi.send(pickle.dumps((n, cudadrv.ipc_handle(addr), need)), dest=key[1],
                                tag=RING_TAGS[key[2]])
        base, slot = end.ring(n)
        dst = base + (n % SLOTS) * slot
        st = end.stream
        st.wait_stream(_cuda.current_stream())  # the tensors are computed
        if n >= SLOTS:
            cudadrv.wait_at_least(st.cuda_stream, end.mine, n - SLOTS + 1)
        for b, off in zip(bufs, offsets, strict=True):
            if b.numel():
                cudadrv.copy(dst + off, b.data_ptr(), _nbytes(b), st.cuda_stream)
        cudadrv.write(st.cuda_stream, end.theirs, n + 1)
        ev = _cuda.Event()
        ev.record(st)
        return Work(ev, bufs)

    def recv(self, key: Key, bufs: list[torch.Tensor]) -> Work:
        end = self.ends[key]
        n = end.count
        end.count += 1
        offsets, need = layout([_nbytes(b) for b in bufs])
        work = Work(None, bufs)
        if end.deferred or not self._known(end, need):
            work.post = lambda: self._post_deferred(end, work)
            end.deferred.append(work)
        else:
            self._pull(end, n, bufs, offsets, work)
        work.n, work.offsets, work.need = n, offsets, need
        return work

    def _known(self, end: _End, need: int) -> bool:
        """Whether a ring holds messages of `need` bytes, reading the sender's ring messages already here (never
        waits for one)."""
        while not (end.rings and need <= end.rings[-1][2]):
            if not self.world.mpi.Iprobe(source=end.key[0], tag=RING_TAGS[end.key[2]]):
                return False
            self._read_ring(end)
        return True

    def _read_ring(self, end: _End) -> None:
        first, handle, slot = pickle.loads(self.world.mpi.recv(source=end.key[0], tag=RING_TAGS[end.key[2]]))
        addr = cudadrv.ipc_open(handle)
        self.pages.append(-addr)  # mapped, not owned: closed, not freed
        end.rings.append((first, addr, slot))

    def _post_deferred(self, end: _End, upto: Work) -> None:
        """Post the deferred receives up to `upto`, in order, reading ring messages as they are needed."""
        while end.deferred and upto.event is None:
            w = end.deferred.pop(0)
            while not end.rings or w.need > end.rings[-1][2]:
                self._read_ring(end)
            self._pull(end, w.n, w.keep, w.offsets, w)

    def _pull(self, end: _End, n: int, bufs: list[torch.Tensor], offsets: list[int], work: Work) -> None:
        base, slot = end.ring(n)
        src = base + (n % SLOTS) * slot
        st = end.stream
        st.wait_stream(_cuda.current_stream())  # the buffers' memory is free on the compute stream's order
        cudadrv.wait_at_least(st.cuda_stream, end.mine, n + 1)
        for b, off in zip(bufs, offsets, strict=True):
            if b.numel():
                cudadrv.copy(b.data_ptr(), src + off, _nbytes(b), st.cuda_stream)
        cudadrv.write(st.cuda_stream, end.theirs, n + 1)
        ev = _cuda.Event()
        ev.record(st)
        work.event, work.post = ev, None
        with self.lock:
            while self.posted and self.posted[0][1].is_completed():
                self.posted.popleft()
            self.posted.append((time.monotonic(), work, end.key[0]))

    def stalled(self, timeout_s: float) -> tuple[int, str] | None:
        """The sender of a receive posted more than `timeout_s` ago that has not arrived, and what to say; None
        if every older one arrived. NCCL's transfers time out; these wait on the GPU without limit, so the
        watchdog's thread asks this (a peer that is alive but never sends keeps its heartbeats)."""
        now = time.monotonic()
        if self.world.device.type == "cuda":  # this thread's current device, or a query makes a context on GPU 0
            _cuda.set_device(self.world.device)
        with self.lock:
            while self.posted and self.posted[0][1].is_completed():
                self.posted.popleft()
            if not self.posted or now - self.posted[0][0] <= timeout_s:
                return None
            posted, _, peer = self.posted[0]
        return peer, (f"a tensor it sends on the copy engines has not arrived after {now - posted:.1f} s "
                      f"(--timeout {timeout_s:g})")

    def close(self) -> None:
        """Unmap the peers' memory and free this rank's (after the device is idle)."""
        _cuda.synchronize()
        for addr in self.pages:
            (cudadrv.ipc_close if addr < 0 else cudadrv.free)(abs(addr))
        self.pages = []


def usable_channels(keys: list[Key], ranks: list[tuple[str, int, list[int]]], mode: str = "auto") -> list[Key]:
    """The channels among `keys` whose two ranks may use the copy engines, from every rank's (host name, local GPU,
    the local GPUs it can access): one host, and each GPU able to access the other's memory. The same on every rank,
    which all read the same list. Mode ce: all of them, else UsageError naming a pair that cannot."""
    def able(a: int, b: int) -> bool:
        (ha, la, pa), (hb, lb, pb) = ranks[a], ranks[b]
        return ha == hb and lb in pa and la in pb

    usable = [k for k in keys if able(k[0], k[1])]
    bad = [k for k in keys if k not in usable]
    if mode == "ce" and bad:
        raise UsageError(f"PIPEFLOW_P2P=ce: ranks {bad[0][0]} and {bad[0][1]} cannot use the copy engines (CUDA GPUs "
                         "of one host with peer access are needed); use PIPEFLOW_P2P=auto or nccl")
    return usable


def setup(world: Any, keys: list[Key], mode: str) -> CopyEngines | None:
    """Collective over all CUDA ranks (MPI): the copy-engine ends of this rank's channels among `keys` (every rank's
    channels, in one order on all ranks), or None where none may use them (mode nccl, CPU, other hosts)."""
    if world.device.type != "cuda":  # every rank's device is of one type: none calls the collective
        return None
    me = (socket.gethostname(), world.local_rank,
          [d for d in range(torch.cuda.device_count()) if d == world.local_rank
           or torch.cuda.can_device_access_peer(world.local_rank, d)] if mode != "nccl" else [])
    usable = usable_channels(keys, world.mpi.allgather(me), mode)
    index = {k: i for i, k in enumerate(usable)}
    ranks = {r for k in usable for r in k[:2]}
    page = cudadrv.alloc(max(ALIGN, 8 * len(usable)), zero=True) if world.rank in ranks else 0
    handles = world.mpi.allgather(cudadrv.ipc_handle(page) if page else None)
    if not usable:
        return None
    pages, mapped = [page] if page else [], {}
    ends: dict[Key, _End] = {}
    for k in usable:
        if world.rank not in k[:2]:
            continue
        peer = k[1] if world.rank == k[0] else k[0]
        if peer not in mapped:
            mapped[peer] = cudadrv.ipc_open(handles[peer])
            pages.append(-mapped[peer])
        i = index[k]
        full, empty = 8 * i, 8 * i + 4  # `full` on the receiver's page, `empty` on the sender's
        if world.rank == k[0]:
            ends[k] = _End(k, world.device, page + empty, mapped[peer] + full)
        else:
            ends[k] = _End(k, world.device, page + full, mapped[peer] + empty)
    log.info("point-to-point on the copy engines: %d of %d channels", len(usable), len(keys))
    return CopyEngines(world, ends, pages)
