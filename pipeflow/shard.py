"""The optimizer state of a replicated stage sharded over its replicas (ZeRO stage 1, Rajbhandari et al. SC'20 §5).

Without it every replica of a stage keeps the optimizer state of all the stage's parameters and runs the whole
update on gradients the all-reduce made identical: r copies of the same work. With `--shard-optimizer` each
parameter has one owner among the replicas; only the owner holds its optimizer state and updates it, then
sends the new weights to the other replicas (large tensors in place, the others in buckets). Elementwise optimizers
(SGD, Adam, AdamW: what pipeflow-train builds) compute each parameter's update from its own gradient and state
alone, so the weights are the same as without sharding, bit for bit. Checkpoints gather the state back
(checkpoint.py), so a file holds every parameter's state either way.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipeflow.comm import exchange
from pipeflow.tensorops import LARGE  # elements from which a tensor is sent alone, in place

log = logging.getLogger(__name__)

BUCKET_BYTES = 64 << 20  # bytes per bucket of small tensors sent: bounds the flat buffer each one needs


def owners(sizes: Sequence[int], replicas: int) -> list[int]:
    """The owning replica of each parameter (by its bytes): the largest first, each to the replica owning the
    fewest bytes so far (ties to the lower index). Deterministic, so every replica computes the same."""
    load = [0] * replicas
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        q = min(range(replicas), key=lambda q: (load[q], q))
        out[i] = q
        load[q] += sizes[i]
    return out


def sharded(params: Sequence[nn.Parameter], replicas: int, replica: int, group: Any,
            ranks: Sequence[int]) -> ShardedUpdate | None:
    """--shard-optimizer on replica `replica` of a stage's `replicas` (over `group`, global `ranks`); None where
    there is nothing to shard: one replica, or fewer parameter tensors than replicas (said in the log)."""
    if replicas == 1:
        return None
    shard = ShardedUpdate(params, replicas, replica)
    if not shard.complete:
        log.warning("--shard-optimizer: the stage has %d parameter tensors for %d replicas; its optimizer state is "
                    "not sharded", len(shard.params), replicas)
        return None
    shard.connect(group, ranks)
    return shard


class ShardedUpdate:
    """One rank's share of its stage's update: `owned` (what its optimizer gets) and, after each optimizer step,
    `broadcast` (every owner's new weights to the other replicas, over the replica group)."""

    def __init__(self, params: Sequence[nn.Parameter], replicas: int, replica: int) -> None:
        self.params = [p for p in params if p.requires_grad]  # frozen weights never change: nothing to send
        self.owner = owners([p.numel() * p.element_size() for p in self.params], replicas)
        self.replicas, self.replica = replicas, replica
        self.owned = [p for p, q in zip(self.params, self.owner) if q == replica]
        self.group: Any = None
        self.ranks: list[int] = []
        self.works: list[Any] = []  # the transfers in flight
        self.pending: list[tuple[torch.Tensor, list[nn.Parameter]]] = []  # bucket buffers, parameters to unpack

    @property
    def complete(self) -> bool:
        """Every replica owns something (a stage of fewer parameter tensors than replicas cannot be sharded)."""
        return len(set(self.owner)) == self.replicas

    def connect(self, group: Any, ranks: Sequence[int]) -> None:
        """The replica group and its global ranks, replica order (plan.json's `ranks`)."""
        self.group, self.ranks = group, list(ranks)
        mine = sum(p.numel() * p.element_size() for p in self.owned)
        total = sum(p.numel() * p.element_size() for p in self.params)
        log.info("optimizer sharded over %d replicas: this rank updates %d of the stage's %d parameter bytes",
                 self.replicas, mine, total)

    def broadcast(self, *, defer: bool = False) -> None:
        """Each owner's parameters to the other replicas, all owners at once, as one batched exchange (every member
        lists the same transfers, so each pair's match in order): a tensor of at least LARGE elements in place (no
        buffer), the rest in buckets of one dtype of at most BUCKET_BYTES, each sent by its owner to every other
        replica. Before 2026-11-27 (late morning) these were broadcasts, one owner after another on one
        communicator: on 2 GPUs each direction of the link idle half the time. The gradients of the parameters this
        rank does not own are dropped, as the optimizer's zero_grad drops the others'. `defer` (2bw on a stage that
        runs ahead, whose next minibatch runs on a stashed copy): return with the transfers in flight, overlapping
        that minibatch; `finish` lands them before a forward reads the live weights (the warm-up forwards of the
        minibatch after copy them, before the next STEP: stash.StashPolicy's `settle`), at the next STEP, and at a
        segment's end."""
        self.finish()
        me = self.ranks[self.replica]
        sends: list[tuple[torch.Tensor, int]] = []
        recvs: list[tuple[torch.Tensor, int]] = []
        with torch.no_grad():
            for q in range(self.replicas):
                mine = [p for p, o in zip(self.params, self.owner) if o == q]
                tensors = [p.data for p in mine if p.numel() >= LARGE and p.is_contiguous()]
                for bucket in _buckets([p for p in mine if p.numel() < LARGE or not p.is_contiguous()]):
                    flat = (torch.cat([p.reshape(-1) for p in bucket]) if q == self.replica else
                            torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device))
                    tensors.append(flat)
                    self.pending.append((flat, bucket if q != self.replica else []))
                if q == self.replica:
                    sends += [(t, r) for r in self.ranks if r != me for t in tensors]
                else:
                    recvs += [(t, self.ranks[q]) for t in tensors]
            self.works = exchange(sends, recvs, self.group)
        for p, q in zip(self.params, self.owner):
            if q != self.replica:
                p.grad = None
        if not defer:
            self.finish()

    def finish(self) -> None:
        """Wait for the transfers in flight and unpack the buckets received."""
        for work in self.works:
            work.wait()
        for flat, bucket in self.pending:
            if bucket:
                parts = flat.split([p.numel() for p in bucket])
                with torch.no_grad():
                    torch._foreach_copy_(list[torch.Tensor](bucket), [f.view_as(p) for f, p in zip(parts, bucket)])
        self.works, self.pending = [], []


def _buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Consecutive runs of one dtype and device of at most BUCKET_BYTES each."""
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > BUCKET_BYTES or (p.dtype, p.device) != (out[-1][0].dtype, out[-1][0].device):
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out
