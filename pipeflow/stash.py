"""Weight versions for the asynchronous schedules: PipeDream weight stashing, vertical sync and 2BW.

Semantics (docs/schedules.md). Version k of a stage is its weights after k optimizer updates.
A microbatch t runs its forward *and* its backward with one version v_s(t); its gradient is
applied to the latest weights (PipeDream SOSP'19 §3.3, weight stashing):

- ``async``: stage s (0-based; j = s+1) steps after every backward. Without replicas
  v_s(t) = max(0, t - n + j): the version that is current when F(t) runs in 1F1B.
  ``--vertical-sync``: every stage uses max(0, t - n + 1), the version stage 0 used (§3.3).
- ``2bw`` (PipeDream-2BW ICML'21 §3.1): minibatch k = microbatches [km, km+m) uses version
  max(0, k-1) on every stage, gradients are accumulated over its m microbatches (loss / m) and
  W(k+1) = W(k) - lr * grad f(W(k-1)); the generic optimizer gets that gradient for the live W(k).

Replicated stages (1F1B-RR). Replica q of a stage with r replicas runs microbatches t = q (mod r).
At every STEP the replicas all-reduce their gradients, so one update consumes one backward per
replica: for ``async`` update u of the stage takes the *mean* of the gradients of microbatches
ur .. ur+r-1 (each of loss scale 1): PipeDream's replicas are data-parallel (DDP) workers, so a
replicated stage steps with the same learning rate per update as the others, on r times the samples
(docs/schedules.md, Replicas); for ``2bw`` it sums the replicas' shares of minibatch u (loss / m each: the
minibatch mean, as in the flush schedules). With replicas, v_s(t) generalises to the version that
is current at F(t): max(0, floor(t / r_s) - w_s), w_s = schedule.warmup_forwards(replicas, s);
vertical sync uses, on every stage, the updates built from the c(t) = r_0 * v_0(t) microbatches
stage 0 had applied: v_s(t) = floor(c(t) / r_s). 2BW's version depends on k only.

Segments (checkpoints). With --checkpoint-dir, an asynchronous run is cut into segments of
--checkpoint-every minibatches (0: the whole run; the last one may be shorter), each a complete
action list that fills and drains: a checkpoint boundary drains an asynchronous pipeline. At a
boundary no microbatch is in flight and no stashed version is live, so a checkpoint is each stage's
weights, optimizer state and data position, as for the flush schedules. Within a segment the rules
above hold with t counted from the segment start and versions from the weights at that start (its
version 0): microbatch t' of the segment uses max(0, t' - n + j) updates into the segment, 2bw's
minibatch k' uses max(0, k' - 1). Global microbatch indices (the data order) stay global
(Engine.begin_segment). Without --checkpoint-dir the run is one segment.

Memory. A forward whose backward comes before the next STEP of its worker runs on the live
parameters; any other runs on a *copy* of its version, taken from a pool of buffers and never
modified while a graph references it: the optimizer writes the live parameters in place, copies
are only written when free. Nothing swaps ``param.data`` under a live graph (the breakage of
PipeDream's runtime on newer PyTorch): the copies are bound into the module as parameters for the
forward only, and their gradients are added to the live parameters' ``.grad`` after the backward.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from pipeflow.hooks import WeightPolicy
from pipeflow.kinds import Weights, schedule_kind, warmup_forwards
from pipeflow.schedule import Action, Kind, Schedule, ScheduleError
from pipeflow.tensorops import copy_weights

log = logging.getLogger(__name__)

VersionFn = Callable[[int], int]


def version_fn(sched: Schedule, stage: int, *, minibatch: int, vertical_sync: bool = False) -> VersionFn:
    """t -> the version of `stage`'s weights that microbatch t uses (module docstring)."""
    reps = sched.replicas
    weights = schedule_kind(sched.name).weights
    if weights is Weights.DOUBLE_BUFFER:
        if vertical_sync:
            raise ScheduleError("--vertical-sync applies to the async schedule; 2bw is already vertical")
        return lambda t: max(0, t // minibatch - 1)
    if weights is not Weights.STASH:
        raise ScheduleError(f"weight versions are for async and 2bw, found schedule {sched.name!r}")
    if minibatch % reps[stage]:
        # One update takes r microbatches; minibatch boundaries (loss reports, the failure supervisor's
        # agreement) must fall on an update of every stage, or a replicated stage waits for the next one.
        raise ScheduleError(f"async: stage {stage} has {reps[stage]} replicas, which must divide the microbatches "
                            f"per minibatch, found m={minibatch}; use --microbatches a multiple of {reps[stage]}")

    def latest(s: int, t: int) -> int:  # updates stage s has made when F(t) runs in 1F1B(-RR)
        return max(0, t // reps[s] - warmup_forwards(reps, s))

    if not vertical_sync:
        return lambda t: latest(stage, t)
    return lambda t: reps[0] * latest(0, t) // reps[stage]


class VersionBook:
    """Which versions one worker must hold as copies, and when; pure (no tensors).

    Walks the worker's action list once to decide, per microbatch, whether its forward can run on the
    live weights (no STEP of this worker between F(t) and B(t)) and how many backwards still need each
    version; then `forward` / `backward` / `step` replay the list and say what to copy and free.
    """

    def __init__(self, actions: list[Action], version: VersionFn, *, sched: Schedule | None = None,
                 worker: int | None = None) -> None:
        self.version = version
        self.live = 0                          # updates applied to the live weights
        self.held: set[int] = set()            # versions held as copies
        self.peak = 0
        self.on_live: set[int] = set()         # microbatches whose forward runs on the live weights
        self.uses: Counter[int] = Counter()    # version -> backwards on a copy still to run
        steps = 0
        f_steps: dict[int, int] = {}
        for idx, a in enumerate(actions):
            if a.kind is Kind.STEP:
                steps += 1
            elif a.kind is Kind.F and a.microbatch is not None:
                t = a.microbatch
                if version(t) > steps:
                    mark = None if sched is None or worker is None else {worker: idx}
                    grid = "" if mark is None or sched is None else "\n" + sched.render(mark)
                    raise ScheduleError(
                        f"F{t} needs weight version {version(t)} but its worker has made only {steps} updates "
                        f"by then; for 2bw use microbatches per minibatch >= stages - 1 (PipeDream-2BW §3.1){grid}")
                f_steps[t] = steps
            elif a.kind is Kind.B and a.microbatch is not None:
                t = a.microbatch
                if f_steps[t] == steps and version(t) == steps:
                    self.on_live.add(t)
                else:
                    self.uses[version(t)] += 1

    def _hold(self, v: int) -> None:
        self.held.add(v)
        self.peak = max(self.peak, len(self.held))

    def forward(self, t: int) -> tuple[int, bool, bool]:
        """(version, on_live, copy_now): copy_now when the live weights must be copied before F(t)."""
        v = self.version(t)
        if t in self.on_live:
            return v, True, False
        if v in self.held:
            return v, False, False
        if v != self.live:
            raise RuntimeError(f"F{t} needs version {v}, which was neither kept nor is live ({self.live})")
        self._hold(v)
        return v, False, True

    def backward(self, t: int) -> int | None:
        """After B(t): the version whose copy is now free, if any."""
        if t in self.on_live:
            return None
        v = self.version(t)
        self.uses[v] -= 1
        if self.uses[v] == 0:
            self.held.discard(v)
            return v
        return None

    def step(self) -> int | None:
        """Before a STEP: the live version, when later forwards still need a copy of it."""
        v = self.live
        self.live += 1
        if self.uses[v] > 0 and v not in self.held:
            self._hold(v)
            return v
        return None


def simulate(actions: list[Action], version: VersionFn) -> int:
    """Peak number of versions held as copies when running `actions` (no tensors)."""
    book = VersionBook(actions, version)
    for a in actions:
        if a.kind is Kind.F and a.microbatch is not None:
            book.forward(a.microbatch)
        elif a.kind is Kind.B and a.microbatch is not None:
            book.backward(a.microbatch)
        elif a.kind is Kind.STEP:
            book.step()
    return book.peak


class StashPolicy(WeightPolicy):
    """Runs each microbatch on its weight version (VersionBook) with pooled copies of the stage's
    parameters; gradients computed on a copy are added to the live parameters' gradients."""

    def __init__(self, module: nn.Module, actions: list[Action], version: VersionFn, *,
                 sched: Schedule | None = None, worker: int | None = None,
                 settle: Callable[[], None] | None = None) -> None:
        self.book = VersionBook(actions, version, sched=sched, worker=worker)
        # Lands what may still be writing the live weights (a sharded update's broadcast, deferred under 2bw's next
        # minibatch, shard.py) before a forward reads them: one that runs on them or copies them.
        self.settle = settle
        # (owning module, attribute name, live parameter) for every parameter, in parameters() order.
        self.slots = [(mod, name, p) for mod in module.modules()
                      for name, p in mod.named_parameters(recurse=False)]
        self.copies: dict[int, list[nn.Parameter]] = {}  # version -> copy
        self.pool: list[list[nn.Parameter]] = []           # free copies (PipeDream reuses stash buffers)
        self.allocated = 0
        self.param_bytes = sum(p.numel() * p.element_size() for _, _, p in self.slots)
        self.bound: int | None = None
        self.current: dict[int, int] = {}  # microbatch -> version it ran on (copies only)

    def _take(self, v: int) -> None:
        if self.pool:
            buf = self.pool.pop()
        else:
            buf = [nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad) for _, _, p in self.slots]
            self.allocated += 1
        with torch.no_grad():  # the buffer is free: no graph references it
            # The large tensors one by one, at the memory's bandwidth, the small ones in one multi-tensor copy
            # (at small microbatches the launches, not the bytes, were the cost of the copy: issue 15).
            copy_weights(list(buf), [p for _, _, p in self.slots])
        self.copies[v] = buf

    def _bind(self, params: list[nn.Parameter]) -> None:
        # Module attributes are rebound to other Parameter objects; no tensor's data is swapped.
        for (mod, name, _), q in zip(self.slots, params):
            mod._parameters[name] = q

    def before_forward(self, mb: int) -> None:
        v, on_live, copy_now = self.book.forward(mb)
        if (on_live or copy_now) and self.settle is not None:
            self.settle()
        if on_live:
            return
        if copy_now:
            self._take(v)
        self._bind(self.copies[v])
        self.bound = v
        self.current[mb] = v

    def after_forward(self, mb: int) -> None:
        if self.bound is not None:
            self._bind([p for _, _, p in self.slots])
            self.bound = None

    def after_backward(self, mb: int) -> None:
        v = self.current.pop(mb, None)
        if v is None:
            self.book.backward(mb)
            return
        into, adds = [], []
        for c, (_, _, p) in zip(self.copies[v], self.slots):
            if c.grad is None:
                continue
            if p.grad is None:
                p.grad = c.grad  # the gradient tensor moves over: no copy
            else:
                into.append(p.grad)
                adds.append(c.grad)
            c.grad = None
        if into:
            torch._foreach_add_(into, adds)
        free = self.book.backward(mb)
        if free is not None:
            self.pool.append(self.copies.pop(free))

    def before_step(self) -> None:
        v = self.book.step()
        if v is not None:
            self._take(v)

    @property
    def peak_bytes(self) -> int:
        """Bytes of copies held at peak (every copy ever allocated stays in the pool)."""
        return self.allocated * self.param_bytes

    def finish(self) -> None:
        log.info("stash peak: %d bytes, %d versions (stage parameters %d bytes)", self.peak_bytes,
                 self.book.peak, self.param_bytes)


def defers_update(actions: list[Action], version: VersionFn) -> bool:
    """Whether a worker can run every microbatch on its live weights, each update applied one STEP late
    (pipeflow/update.py), instead of on copies: every forward between its k-th and (k+1)-th STEP uses version
    max(0, k - 1) and has its backward before the (k+1)-th (2bw's last stage and data parallelism). Copies cost a
    weight copy a minibatch and an all-reduce held until the STEP (no hook fires on a copy's graph, reduce.py)."""
    steps, open_ = 0, set[int]()
    for a in actions:
        if a.kind is Kind.STEP:
            if open_:
                return False
            steps += 1
        elif a.kind is Kind.F and a.microbatch is not None:
            if version(a.microbatch) != max(0, steps - 1):
                return False
            open_.add(a.microbatch)
        elif a.kind is Kind.B and a.microbatch is not None:
            open_.discard(a.microbatch)
    return True


class LiveWeights(WeightPolicy):
    """The policy of a worker whose updates are deferred a STEP (defers_update, pipeflow/update.py): every
    microbatch runs on the live weights, nothing is copied."""


def segment_policy(module: nn.Module, sched: Schedule, worker: int, stage: int, *, minibatch: int,
                   vertical_sync: bool, previous: object, settle: Callable[[], None] | None = None) -> WeightPolicy:
    """The weight policy of a segment's action list (Engine.begin_segment), reusing the previous segment's
    free copies when there was one; the live weights throughout where the worker's updates are deferred
    (defers_update)."""
    version = version_fn(sched, stage, minibatch=minibatch, vertical_sync=vertical_sync)
    if defers_update(sched.actions[worker], version):
        return LiveWeights()
    policy = StashPolicy(module, sched.actions[worker], version, sched=sched, worker=worker, settle=settle)
    if isinstance(previous, StashPolicy):
        policy.pool = previous.pool + list(previous.copies.values())
        policy.allocated = previous.allocated
    return policy
