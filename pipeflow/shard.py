"""The optimizer state of a replicated stage sharded over its replicas (ZeRO stage 1, Rajbhandari et al. SC'20 §5).

Without it every replica of a stage keeps the optimizer state of all the stage's parameters and runs the whole
update on gradients the all-reduce made identical: r copies of the same work. With `--shard-optimizer` each
parameter has one owner among the replicas; only the owner holds its optimizer state and updates it, then
sends the new weights to the other replicas (large tensors in place, the others in buckets). Elementwise optimizers
(SGD, Adam, AdamW: what pipeflow-train builds) compute each parameter's update from its own gradient and state
alone, so the weights are the same as without sharding, bit for bit. Checkpoints gather the state back
(checkpoint.py), so a file holds every parameter's state either way.

Where the next forward reads the live weights (flush schedules; 2bw's deferred updates, update.py), the owners'
weights land layer by layer under it (`arm`): the exchange is split into chunks in the layers' order, each its own
batch, and a forward pre-hook on each layer waits for the chunks up to its own (on a GPU the stream waits, not the
host), as ZeRO/FSDP prefetch a layer's parameters. The exchange of step k then runs beside the first forward of
step k + 1 instead of in its STEP (2 x H200, the 2.68 GB GPT: its sharded 2bw STEP 6.5-6.8 ms, against 12.9-13.5;
benchmarks/gpu/README.md, "the sharded weights landing layer by layer"). Everything else that reads the weights
lands them all first (`finish`: Engine.state_dict, checkpoints, the next STEP, a drain's update, closing).
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
CHUNK_BYTES = 32 << 20  # armed: consecutive layers share a chunk until it holds this many bytes


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
        self.chunk = [0] * len(self.params)  # the chunk each parameter travels in (one, until `arm`)
        self.armed = False
        self.hooks: list[Any] = []  # armed: the layers' forward pre-hooks (removed by `close`)
        # per chunk in flight, in the layers' order: its transfers' works and its bucket buffers with the parameters
        # to unpack them into; `landed` of them are in place
        self.inflight: list[tuple[list[Any], list[tuple[torch.Tensor, list[nn.Parameter]]]]] = []
        self.landed = 0

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

    def arm(self, layers: Sequence[nn.Module]) -> None:
        """Land the owners' weights layer by layer under the next forward (module docstring): `layers` in the order
        their forwards run, consecutive ones sharing a chunk until it holds CHUNK_BYTES; each layer's forward
        pre-hook lands the chunks up to the one holding its parameters. A parameter found in no layer travels in
        the first chunk; one found in several (tied) in that of the first. Not armed where a layer is a TorchScript
        module, which takes no hooks: the exchange then lands in the STEP."""
        scripted = [type(m).__name__ for m in layers if isinstance(m, torch.jit.ScriptModule)]
        if scripted:
            log.info("the owners' weights land in the STEP: %s takes no forward pre-hook (TorchScript)", scripted[0])
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        chunk = [-1] * len(self.params)
        current, size = 0, 0
        for layer in layers:
            mine = [index[id(p)] for p in layer.parameters() if id(p) in index and chunk[index[id(p)]] < 0]
            if not mine:
                continue
            for i in mine:
                chunk[i] = current
                size += self.params[i].numel() * self.params[i].element_size()
            # first among the layer's pre-hooks: one registered before (torch.nn.utils.weight_norm's) reads them
            self.hooks.append(layer.register_forward_pre_hook(lambda _m, _a, c=current: self.land(c), prepend=True))
            if size >= CHUNK_BYTES:
                current, size = current + 1, 0
        self.chunk = [max(c, 0) for c in chunk]
        self.armed = True
        log.info("the owners' weights land layer by layer under the next forward, in %d chunk(s)", max(self.chunk) + 1)

    def broadcast(self, *, defer: bool = False) -> None:
        """Each owner's parameters to the other replicas, all owners at once, as one batched exchange per chunk
        (every member lists the same transfers, so each pair's match in order): a tensor of at least LARGE elements
        in place (no buffer), the rest in buckets of one dtype of at most BUCKET_BYTES, each sent by its owner to
        every other replica. Before 2026-11-27 (late morning) these were broadcasts, one owner after another on one
        communicator: on 2 GPUs each direction of the link idle half the time. The gradients of the parameters this
        rank does not own are dropped, as the optimizer's zero_grad drops the others'. Armed (`arm`): return with
        the transfers in flight, each layer's forward landing its chunk. `defer` (2bw on a stage that runs ahead,
        whose next minibatch runs on a stashed copy): return with them in flight, overlapping that minibatch;
        `finish` lands them before a forward reads the live weights (the warm-up forwards of the minibatch after
        copy them, before the next STEP: stash.StashPolicy's `settle`), at the next STEP, and at a segment's end.
        Otherwise they have landed on return."""
        self.finish()
        me = self.ranks[self.replica]
        chunks = max(self.chunk) + 1  # one unless armed
        with torch.no_grad():
            for c in range(chunks):
                sends: list[tuple[torch.Tensor, int]] = []
                recvs: list[tuple[torch.Tensor, int]] = []
                unpack: list[tuple[torch.Tensor, list[nn.Parameter]]] = []
                for q in range(self.replicas):
                    mine = [p for p, o, k in zip(self.params, self.owner, self.chunk) if o == q and k == c]
                    tensors = [p.data for p in mine if p.numel() >= LARGE and p.is_contiguous()]
                    for bucket in _buckets([p for p in mine if p.numel() < LARGE or not p.is_contiguous()]):
                        flat = (torch.cat([p.reshape(-1) for p in bucket]) if q == self.replica else
                                torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                                            device=bucket[0].device))
                        tensors.append(flat)
                        unpack.append((flat, bucket if q != self.replica else []))
                    if q == self.replica:
                        sends += [(t, r) for r in self.ranks if r != me for t in tensors]
                    else:
                        recvs += [(t, self.ranks[q]) for t in tensors]
                self.inflight.append((exchange(sends, recvs, self.group), unpack))
        for p, q in zip(self.params, self.owner):
            if q != self.replica:
                p.grad = None
        if not (defer or self.armed):
            self.finish()

    def land(self, chunk: int) -> None:
        """The chunks in flight up to `chunk` in place: their transfers waited for (on a GPU, by the current stream)
        and their buckets unpacked."""
        while self.landed < len(self.inflight) and self.landed <= chunk:
            works, unpack = self.inflight[self.landed]
            self.landed += 1
            for work in works:
                work.wait()
            for flat, bucket in unpack:
                if bucket:
                    parts = flat.split([p.numel() for p in bucket])
                    with torch.no_grad():
                        torch._foreach_copy_(list[torch.Tensor](bucket), [f.view_as(p) for f, p in zip(parts, bucket)])
        if self.landed == len(self.inflight):
            self.inflight, self.landed = [], 0

    def finish(self) -> None:
        """Every transfer in flight waited for and every bucket received unpacked."""
        self.land(len(self.inflight))

    def close(self) -> None:
        """The end of training: everything landed, and the layers' hooks removed (the layers are the user's: a
        module that trained sharded pickles, and holds no reference to this)."""
        self.finish()
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.armed = [], False


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
