"""Gradient reduction: the all-reduce among a stage's replicas, bucketed and started during the last
backward (Poseidon ATC'17, wait-free backpropagation), and the sum of a tied parameter's gradient over
every stage that holds it (Megatron-LM's embedding group)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeflow.comm import all_reduce, group_size
from pipeflow.split import LINEAR_NODE
from pipeflow.tensorops import LARGE


class GradReducer:
    """Sums gradients over `group` (`average`: then divides by its size). Buckets follow reverse parameter
    order (the order backward finishes them) and are launched strictly in index order, so every member
    issues the same collectives.

    No gradient is not a zero gradient (docs/reproducibility.md, Optimizer): each bucket carries one presence flag
    per parameter; a parameter no member produced a gradient for keeps grad=None, so momentum, weight decay
    and AdamW leave it alone as torch.optim does in one process; one that some members produced gets the
    sum, absent counting as zero.

    Readiness is decided per backward, not per hook call: `arm(roots)` walks the armed backward's graph and
    expects the parameters whose AccumulateGrad node it reaches. Autograd runs that node once per backward
    (a parameter used twice has its two gradients summed in the node's input buffer first), so each
    expected hook fires once and a bucket launches when all its expected parameters have fired; the others'
    gradients are already final. The hooks exist only from `arm` to `finish()`: in any other backward a
    weight's GEMM may add into .grad itself (split.py), which runs no hook. Nothing launches before `finish()`
    when the graph reaches none of the parameters (a stashed copy's graph: stash.py adds those gradients after
    the backward) or holds a Python autograd Function (other than split.py's Linear), which may run nested
    backwards (reentrant checkpointing) that accumulate into parameters outside that count, any number of
    times. With `overlap=False` (tied parameters) everything launches in `finish()`.

    A parameter of at least `large` elements is a bucket of its own, reduced in place in its .grad (zeros where
    this member has none): copying every gradient into flat buckets held a second copy of all of them until
    the STEP: 19.2 GiB per rank for the 10.3 B GPT's data parallelism, what its measured peak (96.3 GiB on 2
    H200s) exceeded the planner's (83.6, which counts no such copy) by with its activations freed by then.
    Its presence flag travels in one small all-reduce of all such flags, issued in `finish()` and read (a
    device sync) only where this member had no gradient.
    """

    def __init__(self, params: list[nn.Parameter], group: Any, *, average: bool = False,
                 bucket_bytes: int = 25 << 20, overlap: bool = True, large: int = LARGE,
                 exchange: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.group = group
        # How a bucket is summed over the group, in place, returning a work to wait on: NCCL's (gloo's) all-reduce,
        # or for two replicas on peer GPUs the copy engines' (celink.PairSum, PIPEFLOW_REDUCE=ce).
        self.exchange = exchange or (lambda t: all_reduce(t, group, async_op=True))
        self.average = average
        self.buckets: list[list[nn.Parameter]] = []
        self.alone: dict[int, int] = {}  # bucket -> its index among the in-place ones (a large parameter)
        size = bucket_bytes + 1
        for p in reversed([p for p in params if p.requires_grad]):
            if p.numel() >= large:
                self.alone[len(self.buckets)] = len(self.alone)
                self.buckets.append([p])
                size = bucket_bytes + 1
                continue
            if size > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: b for b, ps in enumerate(self.buckets) for p in ps}
        self.waiting = [0] * len(self.buckets)  # expected parameters of each bucket not final yet
        self.next = 0
        # (work, flat, bucket, all present here, the gradients it sums)
        self.works: list[tuple[Any, torch.Tensor | None, int, bool, list[torch.Tensor | None]]] = []
        self.absent: list[int] = []  # in-place buckets whose parameter had no gradient here this step
        self.armed = False
        self.overlap = overlap
        self.hooks: list[Any] = []  # registered only while armed: a hooked weight's GEMM leaves .grad to autograd

    def arm(self, roots: Sequence[torch.Tensor]) -> None:
        """The backward from `roots` is this member's last of the step: reduce as gradients become final."""
        self._arm(*_graph_leaves(roots))

    def arm_params(self, params: Sequence[torch.Tensor]) -> None:
        """The coming W (weight-gradient pass of a split backward, pipeflow/split.py) is this member's last
        work of the step and accumulates each of `params` once: every other gradient is final already."""
        self._arm({id(p) for p in params}, False)

    def _arm(self, leaves: set[int], nested: bool) -> None:
        self.next = 0
        self.waiting = [sum(id(p) in leaves for p in ps) for ps in self.buckets]
        self.armed = self.overlap and not nested and any(self.waiting)
        self._unhook()
        if self.armed:
            self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.bucket_of]
            self._advance()

    def _unhook(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        self.waiting[self.bucket_of[p]] -= 1  # type: ignore[index]
        self._advance()

    def _advance(self) -> None:
        while self.next < len(self.buckets) and self.waiting[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def _launch(self, b: int) -> None:
        ps = self.buckets[b]
        for p in ps:  # nn.Embedding(sparse=True): summed dense, the rows no replica touched zero (the same update)
            if p.grad is not None and p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        if b in self.alone:
            p = ps[0]
            here = p.grad is not None
            if p.grad is None:
                self.absent.append(b)
                p.grad = torch.zeros_like(p)  # what this member adds to the sum
            elif not p.grad.is_contiguous():  # a collective takes contiguous tensors
                p.grad = p.grad.contiguous()
            self.works.append((self.exchange(p.grad), None, b, here, [p.grad]))
            return
        grads = [p.grad for p in ps]
        ref = next((g for g in grads if g is not None), ps[0])
        # Presence flags filled on the device: torch.tensor(list) would copy from the host and sync.
        flags = torch.ones(len(ps), dtype=ref.dtype, device=ref.device)
        for k, g in enumerate(grads):
            if g is None:
                flags[k].zero_()
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, ps)]
                         + [flags])
        self.works.append((self.exchange(flat), flat, b, all(g is not None for g in grads), grads))

    def finish(self) -> None:
        """Launch what backward did not, wait, and write the sums back (None where no member had one)."""
        self.complete(self.launch())

    def launch(self) -> Reduction:
        """Launch what backward did not, and the presence flags', waiting for none: the sums of the gradients
        the parameters hold now, which `complete` writes back. Their .grad may be dropped in between (a
        deferred update's all-reduce runs under the next minibatch, update.py): the reduction holds them."""
        self.armed = False
        self._unhook()
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1
        out = Reduction(self.works, self._presence())
        self.works, self.absent, self.next = [], [], 0
        return out

    def complete(self, red: Reduction) -> None:
        """Wait for `red` and give each parameter its sum (None where no member had one), in the gradient
        tensor it held at the launch where it had one."""
        scale = 1.0 / group_size(self.group) if self.average else None
        flags = red.wait_flags()
        seen: list[float] = []  # the flags, read (a device sync) at the first absent in-place gradient
        for work, flat, b, here, grads in red.works:
            work.wait()
            ps = self.buckets[b]
            if flat is None:  # reduced in place
                g = grads[0]
                assert g is not None
                if scale is not None:
                    g.mul_(scale)
                ps[0].grad = g
                if not here:
                    assert flags is not None  # an in-place bucket: its flags were all-reduced
                    seen = seen or flags.tolist()
                    if not seen[self.alone[b]]:
                        ps[0].grad = None  # no member had one
                continue
            total = sum(p.numel() for p in ps)
            if scale is not None:
                flat[:total].mul_(scale)
            # Present here means present in the sum: read the flags (a device sync) only otherwise.
            present = [True] * len(ps) if here else flat[total:].tolist()
            offset = 0
            for p, held, flag in zip(ps, grads, present):
                n = p.numel()
                chunk = flat[offset:offset + n].view_as(p)
                p.grad = None if not flag else chunk.clone() if held is None else held.copy_(chunk)
                offset += n

    def _presence(self) -> tuple[torch.Tensor, Any] | None:
        """The in-place buckets' presence flags summed over the group (every member, every step, in the same
        order), launched, on the device, unread: (flags, work); None without such buckets."""
        if not self.alone:
            return None
        ref = self.buckets[next(iter(self.alone))][0]
        flags = torch.ones(len(self.alone), dtype=torch.float32, device=ref.device)
        for b in self.absent:
            flags[self.alone[b]].zero_()
        return flags, all_reduce(flags, self.group, async_op=True)


@dataclass
class Reduction:
    """The collectives of one launch (GradReducer.launch), not waited for yet."""

    works: list[tuple[Any, torch.Tensor | None, int, bool, list[torch.Tensor | None]]]
    presence: tuple[torch.Tensor, Any] | None

    def wait_flags(self) -> torch.Tensor | None:
        if self.presence is None:
            return None
        flags, work = self.presence
        work.wait()  # on a GPU: the stream waits, not the host
        return flags


def _graph_leaves(roots: Iterable[torch.Tensor]) -> tuple[set[int], bool]:
    """ids of the leaf tensors whose AccumulateGrad a backward from `roots` runs, and whether the graph
    holds a Python autograd Function (which may run a nested backward, e.g. reentrant checkpointing; split.py's
    Linear runs none)."""
    leaves: set[int] = set()
    nested = False
    stack: list[Any] = []
    for t in roots:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            leaves.add(id(t))
    seen: set[Any] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad nodes name their leaf
        if isinstance(var, torch.Tensor):
            leaves.add(id(var))
        if isinstance(fn, torch.autograd.function.BackwardCFunction) and not isinstance(fn, LINEAR_NODE):
            nested = True
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return leaves, nested


# ------------------------------------------------------------------------------------ tied parameters


@dataclass
class Tie:
    """One Parameter shared by layers of several stages: its uses (layer index, name in the layer) and
    the ranks of every stage (all replicas) that hold it."""

    uses: list[tuple[int, str]]
    stages: list[int]
    ranks: list[int]

    @property
    def keys(self) -> list[str]:
        return [f"{i}.{name}" for i, name in self.uses]


def find_ties(layers: Sequence[nn.Module], stage_layers: Sequence[tuple[int, int]],
              stage_ranks: Sequence[Sequence[int]]) -> list[Tie]:
    """Parameters (by identity, before the layers are split) held by layers of more than one stage,
    in order of first use: the same list on every rank (torchgpipe's verify_module detects them too)."""
    stage_of = {i: s for s, (a, b) in enumerate(stage_layers) for i in range(a, b)}
    uses: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            uses.setdefault(id(p), []).append((i, name))
    ties = []
    for u in uses.values():
        stages = sorted({stage_of[i] for i, _ in u})
        if len(stages) > 1:
            ties.append(Tie(u, stages, sorted({r for s in stages for r in stage_ranks[s]})))
    return ties
