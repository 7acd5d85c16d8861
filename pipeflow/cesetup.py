"""Which point-to-point channels run on the GPUs' copy engines (celink.py), and their set-up.

PIPEFLOW_P2P, the ranks' hosts and peer access, every rank's flags page mapped by its peers, and a probe of the
stream memory operations, agreed by all ranks, with NCCL as the fallback."""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

import torch

from pipeflow import celink
from pipeflow.celink import Key, Rank
from pipeflow.cudadrv import DriverError
from pipeflow.failure import UsageError

log = logging.getLogger("pipeflow.celink")  # one logger name for the copy engines' lines

TRANSPORTS = ("auto", "nccl", "ce")
REDUCE_TRANSPORTS = ("nccl", "ce")


def p2p_transport(environ: Mapping[str, str] = os.environ) -> str:
    """PIPEFLOW_P2P: auto (the copy engines where both GPUs of a channel are peers on one host, else NCCL),
    nccl, or ce (the copy engines, an error where a channel cannot use them). Default auto."""
    text = environ.get("PIPEFLOW_P2P", "auto")
    if text not in TRANSPORTS:
        raise ValueError(f"PIPEFLOW_P2P must be one of {', '.join(TRANSPORTS)}, found {text!r}")
    return text


def reduce_transport(environ: Mapping[str, str] = os.environ) -> str:
    """PIPEFLOW_REDUCE: how a stage's two replicas sum their gradients: nccl (the default: NCCL's all-reduce) or ce
    (each pulls the other's on the copy engines and adds it, celink.PairSum, where the two GPUs are peers on one
    host; NCCL elsewhere and for more replicas)."""
    text = environ.get("PIPEFLOW_REDUCE", "nccl")
    if text not in REDUCE_TRANSPORTS:
        raise ValueError(f"PIPEFLOW_REDUCE must be one of {', '.join(REDUCE_TRANSPORTS)}, found {text!r}")
    return text


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


def setup(world: Rank, keys: list[Key], mode: str) -> celink.CopyEngines | None:
    """Collective over all CUDA ranks (MPI): the copy-engine ends of this rank's channels among `keys` (every rank's
    channels, in one order on all ranks), or None where none may use them (mode nccl, CPU, other hosts). Where the
    driver refuses any step on any rank (no IPC in this container, no stream memory operations), every rank falls
    back to NCCL with a warning, or under mode ce stops with a UsageError naming the rank and the call."""
    if world.device.type != "cuda":  # every rank's device is of one type: none calls the collective
        return None
    me = (socket.gethostname(), world.local_rank,
          [d for d in range(torch.cuda.device_count()) if d == world.local_rank
           or torch.cuda.can_device_access_peer(world.local_rank, d)] if mode != "nccl" else [])
    usable = usable_channels(keys, world.mpi.allgather(me), mode)
    ranks = {r for k in usable for r in k[:2]}
    page, handle, error = 0, None, None
    try:
        if world.rank in ranks:
            page = celink.cudadrv.alloc(max(celink.ALIGN, 8 * len(usable) + 4), zero=True)
            handle = celink.cudadrv.ipc_handle(page)
    except DriverError as e:
        error = str(e)
    handles = world.mpi.allgather(handle)
    if not usable:
        return None
    peers = sorted({k[1] if world.rank == k[0] else k[0] for k in usable if world.rank in k[:2]})
    mapped: dict[int, int] = {}
    try:
        if error is None:
            for peer in peers:
                mapped[peer] = celink.cudadrv.ipc_open(handles[peer])
            if page:
                _probe(world.device, page + 8 * len(usable))
    except DriverError as e:
        error = str(e)
    failed = [(r, e) for r, e in enumerate(world.mpi.allgather(error)) if e]
    if failed:
        for addr in mapped.values():
            celink.cudadrv.ipc_close(addr)
        if page:
            celink.cudadrv.free(page)
        why = f"rank {failed[0][0]}: {failed[0][1]}"
        if mode == "ce":
            raise UsageError(f"PIPEFLOW_P2P=ce: the copy engines cannot be set up ({why}); use PIPEFLOW_P2P=auto "
                             "or nccl")
        log.warning("the copy engines cannot be set up (%s): point-to-point goes through NCCL", why)
        return None
    ends: dict[Key, celink.End] = {}
    for i, k in enumerate(usable):
        full, empty = 8 * i, 8 * i + 4  # `full` on the receiver's page, `empty` on the sender's
        if world.rank == k[0]:
            ends[k] = celink.End(k, world.device, page + empty, mapped[k[1]] + full)
        elif world.rank == k[1]:
            ends[k] = celink.End(k, world.device, page + full, mapped[k[0]] + empty)
    log.info("point-to-point on the copy engines: %d of %d channels", len(usable), len(keys))
    return celink.CopyEngines(world, ends, [page] + [-a for a in mapped.values()] if page else [])


def _probe(device: torch.device, flag: int) -> None:
    """A flag written and waited for on a stream, to the end: stream memory operations work here."""
    st = celink.cuda.Stream(device)
    celink.cudadrv.write(st.cuda_stream, flag, 1)
    celink.cudadrv.wait_at_least(st.cuda_stream, flag, 1)
    celink.cuda.synchronize()
