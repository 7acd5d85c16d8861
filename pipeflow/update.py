"""The optimizer update at a STEP, once the gradients are final: the replicas' all-reduce completed (reduce.py),
the step gate (guard.StepGuard), the optimizer, the sharded optimizer's broadcast (shard.py) and the gradients
dropped; or the same one STEP late.

Deferred updates (2bw's last stage and data parallelism, stash.defers_update). PipeDream-2BW runs minibatch k on
version k - 1 of the weights. Where a worker runs no forward ahead of a minibatch's end, the update that makes
version k need not exist before minibatch k + 1 starts: the STEP ending minibatch k applies minibatch k - 1's
gradient (W_k = update(W_{k-1}, g_{k-1})) and holds g_k until the next STEP or the segment's end (`drain`). Each
update is the same function of the same weights, gradient and optimizer state, in the same order, so the weights
are those of updating at once on copies, bit for bit; but every microbatch runs on the live weights: no weight
copy, no gradients added from a copy's. The held gradient takes the copy's memory (a 1/r share of it with a
sharded optimizer: only the owned parameters' gradients are held).

Late reduction (`late`: a deferred update without a sharded optimizer, ScheduleKind.reduce_waits_a_step). As g_k
is applied only at the next STEP, the replicas' all-reduce of g_k is launched at the STEP ending minibatch k, all
of it at once, and completed at the next, under minibatch k + 1's forwards and backwards instead of beside the
last backward, whose GEMMs its kernels slow (benchmarks/gpu). The gate then decides on g_k at the next STEP, on
the reduced gradient and minibatch k's losses (`checking`), just before the update that applies it.

The gate decides on each gradient when it is final (the gradient and that minibatch's losses, as without
deferral); its outcome, and the device flag of a gate that arms the optimizer to skip on the device
(hooks.arm_device_skip), travel with the held gradient to the update that applies it.

Clipping by the global norm (clip.py, `clip`). The norm's all-gather is launched when the gradient is final, at the
STEP ending its minibatch on every rank (so never with late reduction: the engine turns it off), and read by the
update that applies it: at once under the flush schedules, a STEP later where deferred. 2bw's stages that run ahead
(`postponed`) would wait there for the norm of stage 0, whose STEP comes last, stalling the pipeline; but their next
minibatch runs on a copy of the weights (stash.py), so they hold g_k as a deferred update does and apply it when the
live weights are next read (`settle`: the first forward of minibatch k + 2, or the next STEP, or the segment's end),
by when the norm has long arrived. Nothing reads the weights in between: the same updates, in the same order.

The learning-rate schedule (lrsched.py, `lr`). Each gradient takes its index when it is made, at its STEP, and the
update that applies it sets the lr of that index, whenever it runs (deferred, late, postponed or at once); a skipped
update uses its index up all the same."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from pipeflow.clip import GradClip, Norm
from pipeflow.hooks import StepGate, arm_device_skip
from pipeflow.lrsched import ScheduledLr
from pipeflow.reduce import GradReducer, Reduction
from pipeflow.shard import ShardedUpdate

log = logging.getLogger(__name__)


def optimizer_over(factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                   params: list[torch.nn.Parameter], device: torch.device, comm: Any = None,
                   where: str = "") -> torch.optim.Optimizer:
    """The rank's optimizer over `params`. A rank without any (a stage of activations and pooling only, or a
    sharded replica that owns none) gets one over a frozen empty placeholder, which no update ever touches:
    torch.optim refuses an empty list, and checkpoints, the guard and the reports expect an optimizer.
    Collective over `comm` (MPI; `where`: this rank's stage, for the message): a factory that fails on some ranks
    only (a `requires_grad` filter on a frozen stage: torch's "empty parameter list") left the others waiting for
    it forever; now every rank raises the first failure, in one line (ValueError: pipeflow-train's exit 2)."""
    if not params:
        params = [torch.nn.Parameter(torch.empty(0, device=device), requires_grad=False)]
    made, error = None, None
    try:
        made = factory(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise TypeError(f"it returned {type(made).__name__}, not a torch.optim.Optimizer")
        if isinstance(made, torch.optim.LBFGS):
            raise TypeError("LBFGS steps with a closure that evaluates the whole model again, which a pipeline's "
                            "step cannot give it; use a first-order optimizer (SGD, Adam, AdamW, ...)")
    except Exception as e:  # the user's code: whatever it raises is reported, on every rank
        trainable = sum(p.requires_grad for p in params)
        error = (f"{where}: {type(e).__name__}: {e} (given {len(params)} parameter(s), {trainable} needing gradients"
                 + ("; a stage with nothing to train gets its frozen parameters or a frozen placeholder: make the "
                    "optimizer over what it is given" if not trainable else "") + ")")
    errors = comm.allgather(error) if comm is not None else [error]
    failed = next(((r, e) for r, e in enumerate(errors) if e), None)
    if failed is not None:
        raise ValueError(f"the optimizer factory failed on rank {failed[0]}{failed[1]}; `optimizer` makes a "
                         "rank's optimizer from its stage's parameters, e.g. lambda ps: torch.optim.AdamW(ps, lr=1e-3)")
    assert made is not None
    return made


class Update:
    """One worker's updates: `step` at each STEP, `drain` at a segment's end (applies a held gradient)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                 shard: ShardedUpdate | None, reducers: list[GradReducer], *, deferred: bool, late: bool,
                 broadcast_overlaps: bool, clip: GradClip | None = None, lr: ScheduledLr | None = None) -> None:
        self.optimizer, self.params, self.shard, self.reducers = optimizer, params, shard, reducers
        self.deferred, self.late = deferred, late and bool(reducers)  # late (the engine's rule): with replicas only
        assert not (late and clip), "a clipped gradient must be final at its STEP: no late reduction"
        # The owners' new weights travel under the next minibatch only where it runs on a stashed version; there a
        # clipped update waits for the live weights' next reader instead (module docstring).
        self.overlap = broadcast_overlaps and not deferred
        self.clip, self.postponed = clip, clip is not None and self.overlap
        self.lr = lr
        updated = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.held_mask = [id(p) in updated for p in params]  # what a deferred update holds (the owned ones)
        # (gradients, the gate's outcome, its device flag, their norm in flight, their index: the lr's)
        self.held: tuple[list[torch.Tensor | None], bool, Any, Norm | None, int] | None = None
        self.launched: list[Reduction] = []  # late: this STEP's all-reduce (`reduce`)
        self.in_flight: tuple[list[Reduction], list[torch.Tensor], int] | None = None  # late: g_k's, its losses
        self.checking: list[torch.Tensor] | None = None  # late: the losses the gate checks with the gradient
        if deferred:
            log.info("each update applied one STEP late on the live weights: no weight copies%s",
                     "; the replicas' all-reduce under the next minibatch" if self.late else "")

    def begin(self, step: int) -> None:
        """A run, flush step or segment starts at minibatch `step`: where the lr schedule is (lrsched.py)."""
        if self.lr is not None:
            self.lr.begin(step)

    def reduce(self) -> None:
        """A STEP's first part: the replicas' all-reduce (chunk order, then ties) completed, or launched where late;
        a postponed update applied and the last STEP's deferred broadcast landed before the weights are used."""
        if self.late:
            self.launched = [r.launch() for r in self.reducers]
            return
        for r in self.reducers:
            r.finish()
        self.settle()  # before the policy copies the live weights (Engine._step)

    def settle(self) -> None:
        """Before the live weights are read (stash.StashPolicy's forwards on or copies of them, a STEP): a postponed
        update applied, the last broadcast landed."""
        if self.postponed:
            self._restore()
        if self.shard is not None:
            self.shard.finish()

    def step(self, gate: StepGate | None, losses: list[torch.Tensor]) -> None:
        """A STEP's update, after `reduce`; `losses`: those of the minibatch it ends (where this worker has them)."""
        if self.late:
            for p in self.params:  # the reductions hold them; the next minibatch starts from none
                p.grad = None
            self._complete(gate)  # minibatch k - 1's, gated and applied now
            self.in_flight = (self.launched, list(losses), self._index())
            return
        if not (self.deferred or self.postponed):
            ok = gate is None or gate()
            self._apply(ok, overlap=self.overlap, norm=self._launch(), index=self._index())
            return
        self._restore()  # minibatch k - 1's gradient, applied now (postponed: by `settle` already)
        ok = gate is None or gate()  # minibatch k's gradient and losses, decided now as without deferral
        self.held = ([p.grad if keep else None for p, keep in zip(self.params, self.held_mask)], ok,
                     getattr(self.optimizer, "found_inf", None), self._launch(), self._index())
        for p in self.params:  # held or dropped (a sharded stage's others): the next minibatch starts from none
            p.grad = None

    def drain(self, gate: StepGate | None) -> None:
        """A segment's end: the held gradient applied (checkpoints and --save read the weights), the broadcast
        landed."""
        self._complete(gate)
        self._restore()
        if self.shard is not None:
            self.shard.finish()

    def _complete(self, gate: StepGate | None) -> None:
        """Late reduction: the gradient in flight, reduced, gated and applied."""
        if self.in_flight is None:
            return
        launched, self.checking, index = self.in_flight
        self.in_flight = None
        for r, red in zip(self.reducers, launched):
            r.complete(red)
        for p, keep in zip(self.params, self.held_mask):
            if not keep:  # outside the optimizer: dropped, as a held gradient's
                p.grad = None
        try:
            ok = gate is None or gate()
        finally:
            self.checking = None
        self._apply(ok, overlap=False, index=index)

    def _restore(self) -> None:
        """The held gradient applied; the gradients the parameters hold now (the next minibatch's so far, or none)
        set aside meanwhile and given back."""
        if self.held is None:
            return
        grads, ok, flag, norm, index = self.held
        self.held = None
        fresh = [p.grad for p in self.params]
        for p, g in zip(self.params, grads):
            p.grad = g
        if flag is not None:
            arm_device_skip(self.optimizer, flag)  # the flag the gate computed for this gradient
        self._apply(ok, overlap=False, norm=norm, index=index)
        for p, g in zip(self.params, fresh):
            p.grad = g

    def _launch(self) -> Norm | None:
        """The global norm of the gradient the parameters hold now (final), launched; None without clipping."""
        return self.clip.launch() if self.clip is not None else None

    def _index(self) -> int:
        """The index of the gradient this STEP makes (its update's lr); 0 without a schedule."""
        return self.lr.take() if self.lr is not None else 0

    def close(self) -> None:
        """The end of training (or an agreed stop): a sharded update's transfers landed and its hooks removed."""
        if self.shard is not None:
            self.shard.close()

    def _apply(self, ok: bool, *, overlap: bool, index: int, norm: Norm | None = None) -> None:
        if self.shard is not None:  # the last exchange landed before the owners' weights change (a drain's update)
            self.shard.finish()
        if self.clip is not None and norm is not None:  # scaled even when skipped: every rank waits for its norm
            # Every gradient the norm counted, as clip_grad_norm_(model.parameters()) scales them: those of parameters
            # the optimizer leaves out too (they add up from step to step, as in one process); sharded, the owned.
            grads = [p.grad for p, keep in zip(self.params, self.held_mask)
                     if (keep or self.shard is None) and p.grad is not None]
            ok = self.clip.scale(norm, grads, self.optimizer) and ok
        if self.lr is not None:
            self.lr.set(index)
        if ok:
            self.optimizer.step()
        if self.shard is not None:  # skipped or not, on every replica: the owners' weights to the others
            self.shard.broadcast(defer=overlap)
        self.optimizer.zero_grad(set_to_none=True)
