"""MPI bootstrap -> torch.distributed, and the overlapped point-to-point channels between stages."""
from __future__ import annotations

import logging
import os
import pickle
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.bufpool import BufferPool
from pipeflow.celink import CopyEngines
from pipeflow.cesetup import p2p_transport
from pipeflow.cesetup import setup as setup_copy_engines
from pipeflow.control import META_TAG, Control  # the shape/dtype messages; MPI keeps one (source, tag)'s in order
from pipeflow.cudaenv import eager_cuda_modules
from pipeflow.hostmem import keep_freed_host_memory
from pipeflow.structure import shape_change
from pipeflow.turns import Turns

log = logging.getLogger(__name__)


@dataclass
class World:
    """This process's place in the job: ranks from MPI, tensors through torch.distributed."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str
    mpi: Control = field(repr=False)  # COMM_WORLD's control channel (pipeflow.control)
    timeout_s: float = 300.0  # --timeout: after it the watchdog names a rank gone silent and ends the job

    @property
    def group_timeout_s(self) -> float:  # what pipeflow's process groups wait: twice --timeout (docs/failures.md)
        return 2 * self.timeout_s  # the watchdog names a silent rank first; live ranks waiting on each other end


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_world(*, device: str = "auto", timeout_s: float = 300.0) -> World:
    """Rank, size and local rank from MPI; rank 0 picks the rendezvous address and broadcasts it. CUDA ranks use
    NCCL on GPU `local_rank`; CPU ranks use gloo. A world of one needs no process group."""
    from mpi4py import MPI

    warning = eager_cuda_modules()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch.cuda.is_available() is False")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"{local_size} ranks on this host but only {torch.cuda.device_count()} GPUs: "
                               "NCCL needs one GPU per rank (use fewer ranks per host, or --device cpu)")
        if warning is not None and size > 1:
            log.warning("%s", warning)
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    elif device == "cpu":
        keep_freed_host_memory()  # no page faults for every step's fresh tensors (hostmem.py)
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"--device must be auto, cpu or cuda, found {device!r}")
    world = World(rank, size, local_rank, dev, backend, Control(comm), timeout_s)
    if size == 1 or dist.is_initialized():
        return world
    addr = None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR")
        if host is None:
            host = "127.0.0.1" if local_size == size else socket.gethostbyname(socket.gethostname())
        addr = (host, int(os.environ.get("MASTER_PORT", 0)) or _free_port())
    host, port = world.mpi.bcast(addr, root=0)
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and os.environ.get("PIPEFLOW_NCCL_EAGER_INIT") == "1":
        # Eager init serializes each 2-rank group's p2p ops; lazy gives a channel its own communicator (warm_up).
        kwargs["device_id"] = dev
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    log.debug("rank %d/%d: %s process group at %s:%d", rank, size, backend, host, port)
    return world


def new_groups(world: World, rank_sets: list[list[int]]) -> dict[tuple[int, ...], Any]:
    """One process group per rank set, created in the same order on every rank (torch requires it)."""
    groups: dict[tuple[int, ...], Any] = {}
    for ranks in rank_sets:
        key = tuple(ranks)
        if key in groups or world.size == 1:
            continue
        groups[key] = new_group(list(ranks), timeout_s=world.group_timeout_s)
    return groups


def new_group(ranks: list[int], options: Any = None, *, timeout_s: float) -> Any:
    """A process group of `ranks` (all ranks call it in order); its operations give up after `timeout_s`."""
    return dist.new_group(ranks, pg_options=options, timeout=timedelta(seconds=timeout_s))


def all_reduce(tensor: torch.Tensor, group: Any, *, async_op: bool = False) -> Any:
    """Sum `tensor` in place over `group`; with async_op, the work to wait on."""
    return dist.all_reduce(tensor, group=group, async_op=async_op)


def all_gather(out: torch.Tensor, tensor: torch.Tensor) -> Any:
    """Every rank's 1-element `tensor` into `out` in rank order, launched: an all-reduce of each value at its rank's
    index, zeros elsewhere (exact; torch 2.11 has no all_gather_single). Returns the work to wait on."""
    out.zero_()
    out[dist.get_rank()] = tensor[0]
    return dist.all_reduce(out, async_op=True)


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: Any) -> list[Any]:
    """(tensor, global rank) pairs sent and received over `group` as one batch: under NCCL one group call, every
    direction at once (shard.py); per peer in the order listed. The works to wait on."""
    ops = [dist.P2POp(op, t, r, group) for op, pairs in ((dist.isend, sends), (dist.irecv, recvs)) for t, r in pairs]
    return list(dist.batch_isend_irecv(ops)) if ops else []


def group_size(group: Any) -> int:
    return int(dist.get_world_size(group))


def shutdown() -> None:
    """Tear the process group down if one is up: NCCL may hang at exit when it is left for the destructor."""
    if dist.is_initialized():
        dist.destroy_process_group()


def nccl_p2p_options(max_ctas: int, timeout_s: float) -> Any:
    """NCCL options of a point-to-point group: a high-priority stream, at most `max_ctas` CTAs (0: NCCL's)."""
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    opts._timeout = timedelta(seconds=timeout_s)  # as new_group's timeout=, which torch warns it overrides
    if max_ctas > 0:
        opts.config.max_ctas = max_ctas
        opts.config.min_ctas = min(opts.config.min_ctas, max_ctas) if opts.config.min_ctas > 0 else 1
    return opts


TensorMeta = tuple[tuple[int, ...], torch.dtype, bool]  # shape, dtype, requires_grad


class P2P:
    """Sends and receives between neighbouring stages' ranks.

    Each (sender, receiver, direction) pair has its own process group: NCCL runs a communicator's
    operations in issue order on one stream, so activations and gradients crossing the same pair in
    opposite directions on one communicator would deadlock (each side's receive queued before its send).
    Shapes travel once per (channel, input signature) over MPI and are cached.
    """

    def __init__(self, world: World, groups: dict[tuple[int, int, str], Any], *, window: int | None = None) -> None:
        self.world = world
        self.groups = groups
        self.meta_cache: dict[tuple[int, int, Any], tuple[list[TensorMeta], Any]] = {}  # shapes, structure.py's tree
        # Posted sends not known complete, oldest first (works, bytes); beyond `window` the oldest is waited for.
        self.pending_sends: list[tuple[list[Any], int]] = []
        self.window = window
        self.peak_pending = 0        # most sends held at once, and the most bytes they held
        self.peak_pending_bytes = 0
        self.pool = BufferPool(world.device)  # receive buffers, back after their microbatch's backward
        self.ce: CopyEngines | None = None  # the channels on the copy engines (set up in warm_up)

    def set_window(self, window: int) -> None:
        """Sends to keep before waiting for the oldest (Engine._send_window: what the schedule keeps in
        flight, with slack). Once a rank has posted that many later sends, the peers have answered later
        microbatches than the oldest, and they receive in order: its receive is posted, so waiting for it
        cannot deadlock. Memory held by sends then does not grow with m (docs/schedules.md, Flush schedules)."""
        self.window = window

    def _reap(self) -> None:
        """Drop the sends that completed (polled, never waited for), freeing their buffers. NCCL's works
        report completion when polled; gloo's send works only after wait(), so on CPU the window bounds them."""
        self.pending_sends = [s for s in self.pending_sends if not all(w.is_completed() for w in s[0])]

    def _group(self, src: int, dst: int, direction: str) -> Any:
        try:
            group = self.groups[(src, dst, direction)]
        except KeyError:
            raise RuntimeError(f"no channel {src}->{dst} ({direction}) was set up: the plan and the schedule "
                               "disagree about which ranks talk") from None
        return group.take() if isinstance(group, Turns) else group  # the message's group (links.make_links)

    def send(self, tensors: list[torch.Tensor], dst: int, direction: str, signature: Any = None,
             tree: Any = None) -> None:
        """Non-blocking send; with a signature, first send the shapes (and `tree`, what surrounds the tensors:
        structure.py) if this channel has not seen it."""
        if signature is not None:
            key = (self.world.rank, dst, signature)
            meta = ([(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors], tree)
            cached = self.meta_cache.get(key)
            if cached is None:
                self.world.mpi.send(pickle.dumps(meta), dest=dst, tag=META_TAG)
                self.meta_cache[key] = meta
            elif cached != meta:  # one line, exit 2 (train.py): the model's, not the runtime's, error
                raise shape_change(dst, cached, meta, signature)
        key = (self.world.rank, dst, direction)
        group = self._group(*key)
        bufs = [t.detach().contiguous() for t in tensors]
        works = [self.ce.send(key, bufs)] if self.ce and self.ce.has(key) else _batched(dist.isend, bufs, dst, group)
        self._reap()
        self.pending_sends.append((works, sum(b.numel() * b.element_size() for b in bufs)))
        if self.window is not None:
            self.wait_sends(keep=self.window)
        self.peak_pending = max(self.peak_pending, len(self.pending_sends))
        self.peak_pending_bytes = max(self.peak_pending_bytes, sum(n for _, n in self.pending_sends))

    def knows(self, src: int, signature: Any) -> bool:
        """Whether recv() from `src` for `signature` posts without waiting for the shapes (receives.py)."""
        return (src, self.world.rank, signature) in self.meta_cache

    def recv(self, src: int, direction: str, *, signature: Any = None,
             meta: list[TensorMeta] | None = None) -> tuple[list[torch.Tensor], list[Any]]:
        """Post receives (non-blocking); returns the buffers and the works to wait on before use."""
        if meta is None:
            key = (src, self.world.rank, signature)
            if key not in self.meta_cache:
                self.meta_cache[key] = pickle.loads(self.world.mpi.recv(source=src, tag=META_TAG))
            meta = self.meta_cache[key][0]
        key = (src, self.world.rank, direction)
        group = self._group(*key)
        self._reap()
        bufs = [self.pool.take(shape, dtype) for shape, dtype, _ in meta]
        if self.ce and self.ce.has(key):
            return bufs, [self.ce.recv(key, bufs)]
        return bufs, _batched(dist.irecv, bufs, src, group)

    def release(self, bufs: list[torch.Tensor], keep: list[torch.Tensor] | None = None) -> None:
        """Receive buffers of a microbatch whose backward ran go back to the pool (bufpool.BufferPool.release)."""
        self.pool.release(bufs, keep)

    def warm_up(self, reduce_keys: list[tuple[int, int, str]] | None = None) -> None:
        """Set up the copy-engine channels (celink, PIPEFLOW_P2P), then open every NCCL channel once, in the
        order all ranks created them: NCCL creates a communicator at its first use and blocks the host until the
        peer joins, which must not happen mid-schedule. Each pair finishes its exchange before either side moves
        on, so this cannot deadlock."""
        if self.world.size == 1:
            return
        self.ce = setup_copy_engines(self.world, list(self.groups) + (reduce_keys or []), p2p_transport())
        probe = torch.zeros(1, device=self.world.device)
        for src, dst, d in self.groups:
            if (self.ce and self.ce.has((src, dst, d))) or self.world.rank not in (src, dst):
                continue
            group = self._group(src, dst, d)  # both ends: the probe is each channel's first message
            works = (_batched(dist.isend, [probe], dst, group) if self.world.rank == src
                     else _batched(dist.irecv, [probe], src, group))
            for w in works:
                w.wait()
            if self.world.device.type == "cuda":
                torch.cuda.synchronize(self.world.device)

    def ring_bytes(self) -> int:
        """Device memory the copy-engine channels hold outside torch's allocator (celink)."""
        return self.ce.ring_bytes if self.ce else 0

    def close(self) -> None:
        """Free the copy-engine channels' memory (every rank, once its last transfer is done)."""
        if self.ce:
            self.ce.close()
            self.ce = None

    def expect_meta(self, src: int, signature: Any) -> tuple[list[TensorMeta], Any]:
        """The shapes and the structure (structure.py) received from `src` for `signature`."""
        return self.meta_cache[(src, self.world.rank, signature)]

    def wait_sends(self, keep: int = 0) -> None:
        """Complete all but the newest `keep` sends and drop them (their buffers may then be freed)."""
        n = max(len(self.pending_sends) - keep, 0)
        for works, _ in self.pending_sends[:n]:
            for w in works:
                w.wait()
        del self.pending_sends[:n]


def _batched(op: Any, bufs: list[torch.Tensor], peer: int, group: Any) -> list[Any]:
    """Post `op` (isend or irecv) of every buffer with `peer` as one batch, as torch's pipelining does: under NCCL
    one coalesced launch on the group's own communicator, so no "unbatched P2P op ... lazy initialization" warning
    and no extra 2-rank communicator per pair (each group is already one pair and direction); gloo posts them one
    by one. Returns the works to wait on (NCCL: one for the batch)."""
    if not bufs:
        return []
    return list(dist.batch_isend_irecv([dist.P2POp(op, b, peer, group) for b in bufs]))
