"""pipeflow's Python API: a pipeline built from your own layers and loss, stepped from your own loop
(torch.distributed.pipelining's `schedule.step(x, target=y)` is the model); `pipeflow-train` is a thin
wrapper over it (runner.py). Run the script under MPI, every rank the same code (docs/api.md):

    pipe = pipeflow.Pipeline(layers, loss_fn, plan="plan.json", schedule="1f1b", microbatches=4,
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    for x, y in batches:                  # the same minibatch on every rank
        loss = pipe.step(x, target=y)     # a float on the rank that owns the loss, None elsewhere
    state = pipe.state_dict()             # the whole model on rank 0 (nn.Sequential(*layers)'s keys)
    pipe.close()
"""
from __future__ import annotations

import contextlib
import copy
import logging
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from partitioner.plan import Plan, PlanError, even_plan
from pipeflow.hooks import Feed, GateFactory, Timing
from pipeflow.kinds import TABLE
from pipeflow.lrsched import LrSchedule
from pipeflow.spec import ModelSpec

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class BatchFeed:
    """The engine's data source for Pipeline.step(x, target): microbatch j of the minibatch given last,
    the rows [i*b, (i+1)*b) of every tensor of it, i = j - step*m (the global index pipeflow-train's
    MicrobatchLoader uses, so that both give the engine the same microbatches)."""

    def __init__(self, microbatches: int, caller: str = "Pipeline.step") -> None:
        self.m = microbatches
        self.caller = caller  # the method its errors name
        self.first = 0  # global index of the current minibatch's microbatch 0
        self.parts: list[tuple[Any, Any]] = []

    def set(self, step: int, x: Any, target: Any) -> None:
        leaves, spec = tree_flatten(x)
        if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
            raise TypeError(f"{self.caller}: x must be a tensor or a tuple, list or dict of tensors, found "
                            f"{type(x).__name__}")
        size = leaves[0].shape[0] if leaves[0].dim() else 0
        if size < 1 or size % self.m or any(t.dim() == 0 or t.shape[0] != size for t in leaves):
            raise ValueError(f"{self.caller}: the minibatch must split into {self.m} microbatches of equal size "
                             f"along dimension 0; found shapes {[tuple(t.shape) for t in leaves]}")
        if target is not None and (not isinstance(target, torch.Tensor) or target.dim() == 0
                                   or target.shape[0] != size):
            found = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
            raise ValueError(f"{self.caller}: target must be a tensor of {size} rows (one per sample of x), "
                             f"found {found}")
        b = size // self.m
        xs = [tree_unflatten([t[i * b:(i + 1) * b] for t in leaves], spec) for i in range(self.m)]
        ys = [target[i * b:(i + 1) * b] if target is not None else None for i in range(self.m)]
        self.first, self.parts = step * self.m, list(zip(xs, ys))

    def microbatch(self, j: int) -> tuple[Any, Any]:
        return self.parts[j - self.first]

    def signature(self, j: int) -> tuple[tuple[int, ...], ...]:
        """The shapes of microbatch j's input tensors (every rank has them: no exchange unless they change)."""
        return tuple(tuple(t.shape) for t in tree_flatten(self.microbatch(j)[0])[0])


class Pipeline:
    """One rank's part of a pipeline-parallel model: build it on every rank of an MPI job with the same
    arguments; each rank keeps only its stage's layers (and their optimizer).

    `layers`: the model as a list of modules, layer i's output layer i+1's input; `loss_fn(output, target)`
    the last stage's loss (a mean over the microbatch's samples). `plan`: a partitioner.plan.Plan or the
    path of a plan.json (pipeflow-plan), or None: the layers split evenly over one stage per rank.
    `schedule` and `microbatches` override the plan's (default 1f1b and 8 without a plan). `optimizer`
    makes a rank's optimizer from its parameters. `warmup`: 1f1b's forwards before the first backward per
    stage (None: the schedule's minimum). The keyword arguments after `vertical_sync` are pipeflow-train's
    (its world, data, monitor, non-finite guard and segments); `shard_optimizer`: a replicated stage's optimizer
    state split over its replicas, each updating its share and sending it to the others (pipeflow/shard.py);
    `clip_grad_norm`: before each update, the gradients scaled as torch.nn.utils.clip_grad_norm_(model.parameters(),
    clip_grad_norm) scales them in one process, the norm taken over every stage (pipeflow/clip.py; not under async);
    `lr_schedule`: a pipeflow.LrSchedule (warm-up, cosine or linear decay) that sets each param group's lr before
    every update, the group's lr as the optimizer factory set it the peak (pipeflow/lrsched.py).
    """

    def __init__(self, layers: Sequence[nn.Module], loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *,
                 optimizer: OptimizerFactory, plan: Plan | str | None = None, schedule: str | None = None,
                 microbatches: int | None = None, dtype: torch.dtype | None = None, device: str = "auto",
                 seed: int = 0, timeout: float = 300.0, warmup: list[int] | None = None,
                 vertical_sync: bool = False, world: Any = None, data: Feed | None = None,
                 timer: Timing | None = None, step_gate: GateFactory | None = None, total_steps: int = 1,
                 segment_steps: int | None = None, shard_optimizer: bool = False,
                 clip_grad_norm: float | None = None, lr_schedule: LrSchedule | None = None) -> None:
        from pipeflow.comm import init_world
        from pipeflow.config import check_clip_grad_norm
        from pipeflow.engine import Engine
        from pipeflow.planning import check_model_on_plan, replicated_statistics
        from pipeflow.replicabuffers import BufferWatch
        from pipeflow.trainable import TrainableWatch

        if microbatches is not None and microbatches < 1:
            raise ValueError(f"Pipeline: microbatches must be >= 1, found {microbatches}")
        spec = ModelSpec(list(layers), loss_fn, dataset=[])  # type: ignore[arg-type]  # data come by step()
        self.world = world if world is not None else init_world(device=device, timeout_s=timeout)
        self.plan = _resolve_plan(plan, len(spec.layers), self.world.size, schedule, microbatches)
        check_clip_grad_norm(clip_grad_norm, self.plan.schedule, flag="Pipeline: clip_grad_norm", what="schedule")
        check_model_on_plan(spec, self.plan, self.world.device.type)
        note = replicated_statistics(spec, self.plan)
        if note and self.world.rank == 0:
            logging.getLogger("pipeflow").warning(note)
        self.m = self.plan.microbatches
        self.feed = BatchFeed(self.m) if data is None else None
        loader = data if data is not None else self.feed
        assert loader is not None
        self.engine = Engine(self.world, self.plan, spec, schedule=self.plan.schedule, optimizer_factory=optimizer,
                             loader=loader, dtype=dtype, total_steps=total_steps, timer=timer,
                             vertical_sync=vertical_sync, warmup=warmup, segment_steps=segment_steps, seed=seed,
                             step_gate=step_gate, shard_optimizer=shard_optimizer, clip_norm=clip_grad_norm,
                             lr_schedule=lr_schedule)
        self.step_count = 0  # minibatches trained: the next step's data index (a resumed run sets it)
        self.unread = 0      # minibatches whose losses take_loss has not read yet
        self.in_step = False  # inside step() or run_segment() (or after one that failed): no evaluate()
        self.trainable = TrainableWatch(self.engine)  # requires_grad changed between steps of your loop
        self.buffers = BufferWatch(self.engine)  # a replicated stage's forward updates buffers: warned after step 1

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """This rank's optimizer (of its stage's parameters)."""
        return self.engine.optimizer

    @property
    def owns_loss(self) -> bool:
        """Whether step() returns the loss on this rank (the last stage's first replica)."""
        return bool(self.engine.owns_loss)

    def step(self, x: Any = None, target: torch.Tensor | None = None, *, loss: bool = True) -> float | None:
        """Train one minibatch: split `x` (a tensor or a tuple of tensors, samples along dimension 0) and
        `target` into the plan's microbatches, run the schedule, apply the optimizer step. Call it on every
        rank with the same minibatch (the first stage reads x, the last the target, the others x's shapes).
        Returns the minibatch's mean loss on the rank that owns it, None elsewhere; `loss=False` skips
        reading it (no device sync; the next read averages over the minibatches since the last one)."""
        if self.feed is not None:
            if x is None:
                raise ValueError("Pipeline.step needs the minibatch: step(x, target=y) on every rank")
            if target is None and self.engine.stage.last:
                raise ValueError("Pipeline.step needs target= on the last stage's ranks (the loss's input)")
            self.feed.set(self.step_count, x, target)
            self.trainable.check(self.step_count)  # collective: what any rank froze or unfroze since the last step
        elif x is not None or target is not None:
            raise ValueError("this Pipeline reads its data from the loader it was built with; call step()")
        self.in_step = True  # until the step ends: evaluate() refuses to run inside it
        with self._all_or_none(), self.buffers.first_step():
            if self.engine.flush:
                self.engine.train_step(self.step_count)
            else:  # an asynchronous schedule: a segment of one minibatch, which fills and drains (stash.py)
                self.engine.begin_segment(self.step_count, 1)
                self.engine.run(self.engine.actions)
        self.in_step = False
        self.step_count += 1
        self.unread += 1
        return self.take_loss() if loss else None

    def run_segment(self, first: int, steps: int, on_step: Callable[[int], None] | None = None) -> None:
        """Asynchronous schedules, data from the loader: minibatches [first, first + steps) as one action
        list; `on_step(n)` after its n-th optimizer step (pipeflow-train's checkpoints cut segments)."""
        self.in_step = True
        self.engine.begin_segment(first, steps)
        with self.buffers.first_step():
            self.engine.run(self.engine.actions, on_step=on_step)
        self.in_step = False
        self.step_count = first + steps
        self.unread += steps

    def evaluate(self, x: Any = None, target: torch.Tensor | None = None, *, data: Feed | None = None,
                 first: int = 0) -> float | None:
        """Forward only: the mean loss over the microbatches of one minibatch, split as step() splits it, with every
        layer in eval mode (as model.eval(); each put back in its own mode after) under torch.no_grad: no gradient,
        no update, nothing kept (pipeflow/evaluate.py). Returns it on the rank that owns the loss, None elsewhere.
        Collective: call it on every rank with the same minibatch, between steps; it uses the current weights (under
        async and 2bw, the latest: each step drains its pipeline). `data`, `first` (pipeflow-train's): microbatches
        first .. first + m - 1 of a loader instead of x and target."""
        from pipeflow.evaluate import evaluate

        if self.in_step:
            raise RuntimeError("Pipeline.evaluate: called inside a training step (from a hook or callback of step or "
                               "run_segment, or after one that failed), where microbatches are in flight and, under "
                               "async and 2bw, stashed weights are in use; call it between steps")
        if data is None:
            if x is None:
                raise ValueError("Pipeline.evaluate needs the minibatch: evaluate(x, target=y) on every rank")
            if target is None and self.engine.holds_last:
                raise ValueError("Pipeline.evaluate needs target= on the last stage's ranks (the loss's input)")
            feed = BatchFeed(self.m, caller="Pipeline.evaluate")
            feed.set(0, x, target)
            data, first = feed, 0
        elif x is not None or target is not None:
            raise ValueError("Pipeline.evaluate takes the minibatch (x, target) or data=, not both")
        with self._all_or_none():
            return evaluate(self.engine, data, first)

    @contextlib.contextmanager
    def _all_or_none(self) -> Iterator[None]:
        """A schedule's run in your loop (data given to step): an error on one rank (a layer's own, autograd's, out of
        memory) left its peers waiting for it forever; the job now ends there, the error and its traceback on
        stderr, as `python -m mpi4py` ends it (pipeflow-train reports and ends it itself)."""
        try:
            yield
        except Exception as e:
            if self.feed is None or self.world.size == 1:
                raise
            from pipeflow.control import abort_comm
            from pipeflow.failure import say

            say("".join(traceback.format_exception(e)) + f"pipeflow: rank {self.world.rank}: {type(e).__name__}: {e} "
                "(its peers cannot go on without it: the job ends)")
            abort_comm(self.world.mpi, 1)
            raise

    def grad_norm(self) -> float | None:
        """With clip_grad_norm: the global L2 norm of the last clipped gradient before clipping (what
        torch.nn.utils.clip_grad_norm_ returns), the same on every rank; None without it or before the first update.
        It reads the device: call it at reports, not every step. 2bw's last stage applies each gradient a STEP late:
        its norm is then the previous minibatch's."""
        clip = self.engine.update.clip
        return None if clip is None or clip.last_norm is None else float(clip.last_norm)

    def lr(self, step: int | None = None) -> float:
        """The learning rate of the update of minibatch `step` (0-based; default: the last one trained) for this
        rank's first param group: lr_schedule's value from that group's peak; without one, the optimizer's lr now."""
        scheduled = self.engine.update.lr
        if scheduled is None:
            return float(self.optimizer.param_groups[0]["lr"])
        return scheduled.at(max(0, self.step_count - 1) if step is None else step)

    def take_loss(self, minibatches: int | None = None) -> float | None:
        """The mean loss of the microbatches run since the last read (`minibatches` of them: default, all
        since then), on the rank that owns the loss; None elsewhere. Collective over the last stage's replicas."""
        count = self.unread if minibatches is None else minibatches
        self.unread = 0
        return self.engine.take_loss(max(1, count) * self.m)

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights with nn.Sequential(*layers)'s keys, gathered on rank 0 from each
        stage's first replica (None on the other ranks). Collective: call it on every rank."""
        mine = (self.engine.stage.start, self.engine.state_dict()) if self.engine.r == 0 else None
        parts = self.world.mpi.gather(mine, root=0)
        if parts is None:  # not rank 0
            return None
        full: dict[str, torch.Tensor] = {}
        for _, part in sorted((p for p in parts if p is not None), key=lambda p: p[0]):
            full.update(part)
        # A rank holding several chunks (interleaved) sends non-adjacent layers: order the keys by layer.
        return dict(sorted(full.items(), key=lambda kv: int(kv[0].partition(".")[0])))

    def close(self) -> None:
        """Free the copy-engine channels' memory and tear down the process groups (NCCL may hang at exit when
        they are left to the destructor)."""
        from pipeflow.comm import shutdown

        self.engine.update.close()  # no transfer left in flight, no hook left on the layers (shard.py)
        self.engine.p2p.close()
        shutdown()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve_plan(plan: Plan | str | None, num_layers: int, world_size: int, schedule: str | None,
                  microbatches: int | None) -> Plan:
    """The plan given (loaded from its path), with `schedule` and `microbatches` overriding its own; or an
    even split over one stage per rank. Checked against the layers and the world (PlanError in one line)."""
    if plan is None:
        name = schedule or "1f1b"  # an unknown name is refused by the plan's own check, as for a given plan
        v = next((k.default_virtual_stages for k in TABLE if k.name == name), 1)
        return even_plan(num_layers, world_size, schedule=name, microbatches=microbatches or 8, virtual_stages=v)
    if isinstance(plan, str):
        plan = Plan.load(plan)
    elif isinstance(plan, Plan):  # a copy: the overrides below must not change the caller's
        plan = copy.deepcopy(plan)
    else:
        raise PlanError(f"Pipeline: plan must be a Plan, the path of a plan.json or None, found "
                        f"{type(plan).__name__}")
    plan.validate(num_layers=num_layers, world_size=world_size)
    if microbatches is not None:
        plan.microbatches = microbatches
    if schedule is not None:
        plan.set_schedule(schedule)
    return plan
