"""A stage's forwards and backwards replayed as CUDA graphs (PIPEFLOW_CUDA_GRAPHS=1): one launch per action.

The host issues one launch per action instead of every kernel of every layer. At small microbatches a GPU finishes
a layer's kernels about as fast as the host issues them, and the stage runs at the host's pace, which on a shared VM
moves from second to second. A graph replays the kernels an action issued when it was captured, at the same
addresses, so:

- The first step runs as usual (eager) and records, per action, what it was given: the order of the stage's
  forwards (F) and backwards (B), the shapes, dtypes and structure of each microbatch's inputs, target and
  incoming gradients.
- When the second step begins (CaptureAtStep, the engine's weight hooks), every action of a step is captured
  once, in that order, into one memory pool (PyTorch's rule for a shared pool: replayed in the order captured, one
  at a time), with static tensors for what comes in. Nothing runs during a capture; the saved activations of a
  microbatch live in the pool from its forward's capture until its backward's, as they would in an eager step, so
  the pool's size is an eager step's peak. The memory the eager step left cached is released first: between two
  steps of a flush every message of the first is posted on both ends and no peer needs this rank's second step to
  post its side, so the device may synchronise (the synchronisation completes them). (A stage driven without that
  hook captures at the second step's first forward, without synchronising, and keeps the cache.)
- From then on each action copies what it is given into its static tensors and replays its graph. The first
  backward to reach a parameter was captured with .grad unset, so its replay writes the gradient and the others
  add to it, as autograd accumulates; .grad is pointed at that memory again after each backward (the update sets
  it to None).

A replicated stage's all-reduce, armed during the last backward by autograd hooks in an eager step, is launched
whole at the STEP after a replay (which runs no hook; engine.py arms them only for a backward whose forward the
stage saved, and a replay saves none), as the sum of a parameter tied across stages always is: it no longer
overlaps the last backward.

What a graph cannot follow is refused before the first step (`check_graphs`): a CPU device, schedules other than
gpipe and 1f1b (weight versions, split backwards, several chunks per rank) and layers that draw random numbers
(per-microbatch seeding is host state; docs/reproducibility.md: Dropout and RReLU modules, and modules with a
`dropout` above 0, are found; a random function called in a forward is not). An action whose inputs differ from the
first step's (shape, dtype, structure), that comes out of the first step's order, or whose capture fails stops the
run with one line (UsageError). What a graph holds is the module as captured: a layer switched to eval() or a
parameter frozen after the first step goes on as it was.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from partitioner.plan import Plan
from pipeflow.failure import UsageError
from pipeflow.graphcheck import graphs_enabled
from pipeflow.hooks import WeightHooks, WeightPolicy
from pipeflow.spec import model_dtype
from pipeflow.stage import Stage


def make_stages(layers: list[nn.Module], plan: Plan, group: int, **kwargs: Any) -> dict[int, Stage]:
    """This rank's chunks (stage k for k mod S == group), as GraphedStage under PIPEFLOW_CUDA_GRAPHS=1 (which
    pipeflow-train and Pipeline checked at set-up: planning.check_model_on_plan), else Stage; `kwargs`: Stage's
    loss_fn, device, dtype and seed."""
    K = len(plan.stages)
    make = GraphedStage if graphs_enabled() else Stage
    inputs = model_dtype(nn.ModuleList(layers))  # the whole model's, as one process casts its inputs
    return {k: make(layers[st.layers[0]:st.layers[1]], start=st.layers[0], first=k == 0, last=k == K - 1,
                    inputs=inputs, **kwargs) for k, st in enumerate(plan.stages) if k % plan.groups == group}


def weight_hooks(stages: dict[int, Stage]) -> WeightHooks:
    """A flush schedule's weight hooks for this rank's stages: CaptureAtStep where they replay graphs."""
    graphed = [s for s in stages.values() if isinstance(s, GraphedStage)]
    return CaptureAtStep(graphed) if graphed else WeightPolicy()


class CaptureAtStep(WeightPolicy):
    """The live weights throughout (a flush schedule's), and each graphed stage captured when the second step
    begins, before any of its messages is posted (a run of one step captures nothing)."""

    def __init__(self, stages: list[GraphedStage]) -> None:
        self.stages = stages

    def begin_actions(self) -> None:
        for stage in self.stages:
            stage.capture_recorded()


class _Tensor(NamedTuple):
    """A tensor argument as a graph must see it again."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _meta(leaves: list[Any]) -> list[Any]:
    """What a replay must see again: each tensor's shape, dtype and requires_grad, any other leaf itself."""
    return [_Tensor(tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else t for t in leaves]


def _show(meta: list[Any]) -> str:
    """Arguments as an error names them: each tensor's dtype and shape (and whether it requires grad), other
    values but None (no target, no gradient)."""
    return ", ".join(f"{str(m.dtype).removeprefix('torch.')}{list(m.shape)}" + (" requiring grad" if m.requires_grad
                     else "") if isinstance(m, _Tensor) else repr(m) for m in meta if m is not None)


def _static(meta: list[Any], device: torch.device) -> list[Any]:
    """The tensors a graph reads, one per tensor of `meta`: zeros (a valid index, a finite value, for the warm-up),
    contiguous, on the device; other leaves as they were."""
    return [torch.zeros(m.shape, dtype=m.dtype, device=device).requires_grad_(m.requires_grad)
            if isinstance(m, _Tensor) else m for m in meta]


class _Slot:
    """One action of a step: its graph and the static tensors it reads and writes."""

    def __init__(self, kind: str, mb: int, given: list[Any], spec: Any, extra: Any) -> None:
        self.kind, self.mb = kind, mb
        self.spec, self.extra = spec, extra  # the structure of the first step's arguments, what else they were
        self.meta = _meta(given)             # no tensor of theirs is kept
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[Any] = []
        self.result: list[Any] = []  # F: what forward returned (outputs or [loss]); B: the input gradients
        self.tree: Any = None        # F on a stage that sends: the structure of its outputs

    def load(self, stage: str, leaves: list[Any]) -> None:
        """Copy this step's arguments into the static tensors; a difference from the first step stops the run."""
        if _meta(leaves) != self.meta:
            raise UsageError(f"PIPEFLOW_CUDA_GRAPHS=1: {stage}'s {self.kind} of microbatch {self.mb} was given "
                             f"{_show(_meta(leaves))}, but its graph was captured for {_show(self.meta)} (the first "
                             f"step's); graphs need every step's shapes alike: unset PIPEFLOW_CUDA_GRAPHS")
        with torch.no_grad():
            for s, t in zip(self.static, leaves):
                if isinstance(t, torch.Tensor):  # from the host as Stage.to_device copies: pinned, not waited for
                    s.copy_(t.pin_memory() if t.device.type == "cpu" else t, non_blocking=True)


class GraphedStage(Stage):
    """A Stage whose F and B actions, from the second step on, replay CUDA graphs (module docstring): captured by
    `capture_recorded` when the engine's second step begins (CaptureAtStep), or else at the first forward of a
    microbatch index seen before (a flush schedule numbers a step's microbatches from 0 again)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots: list[_Slot] = []      # the first step's actions, in order
        self.index: dict[tuple[str, int], _Slot] = {}
        self.cursor = 0                   # the next slot a replay expects
        self.captured = False
        self.pool: Any = None
        self.grads: list[tuple[nn.Parameter, torch.Tensor]] = []  # each parameter's .grad in the pool

    # -- the first step: eager, recorded ---------------------------------------------------------------------------
    def forward(self, mb: int, inputs: list[torch.Tensor] | Any, target: torch.Tensor | None = None,
                *, loss_scale: float = 1.0, global_mb: int | None = None, tree: Any = None) -> list[torch.Tensor]:
        if not torch.is_grad_enabled():
            return super().forward(mb, inputs, target, loss_scale=loss_scale, global_mb=global_mb, tree=tree)
        leaves, spec = tree_flatten((inputs, target))
        if not self.captured and ("F", mb) not in self.index:  # the first step goes on
            self._record(_Slot("F", mb, leaves, spec, (loss_scale, tree)))
            return super().forward(mb, inputs, target, loss_scale=loss_scale, global_mb=global_mb, tree=tree)
        if not self.captured:  # a microbatch index again: the second step's first forward
            self._capture()
        slot = self._next("F", mb)
        if (loss_scale, tree) != slot.extra:
            raise UsageError(f"PIPEFLOW_CUDA_GRAPHS=1: {self._name()}'s F of microbatch {mb} changed its loss scale "
                             f"or input structure since the first step")
        slot.load(self._name(), leaves)
        assert slot.graph is not None
        slot.graph.replay()
        if self.last:
            return [slot.result[0].clone()]  # the loss outlives the next step's replay (losses are read later)
        self.trees[mb] = slot.tree
        return list(slot.result)

    def backward(self, mb: int, grads: list[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        leaves = list(grads) if grads is not None else []
        if not self.captured:
            self._record(_Slot("B", mb, leaves, None, grads is None))
            return super().backward(mb, grads)
        slot = self._next("B", mb)
        if (grads is None) != slot.extra:
            raise UsageError(f"PIPEFLOW_CUDA_GRAPHS=1: {self._name()}'s B of microbatch {mb} got gradients where "
                             f"the first step got none, or the reverse")
        slot.load(self._name(), leaves)
        assert slot.graph is not None
        slot.graph.replay()
        for p, g in self.grads:
            p.grad = g
        return list(slot.result)

    def _record(self, slot: _Slot) -> None:
        if (slot.kind, slot.mb) in self.index:
            raise UsageError(f"PIPEFLOW_CUDA_GRAPHS=1: {self._name()} ran {slot.kind} of microbatch {slot.mb} twice "
                             f"in its first step")
        self.slots.append(slot)
        self.index[(slot.kind, slot.mb)] = slot

    def _next(self, kind: str, mb: int) -> _Slot:
        slot = self.slots[self.cursor]
        if (slot.kind, slot.mb) != (kind, mb):
            raise UsageError(f"PIPEFLOW_CUDA_GRAPHS=1: {self._name()} ran {kind} of microbatch {mb} where its "
                             f"first step ran {slot.kind} of microbatch {slot.mb}; graphs replay one order")
        self.cursor = (self.cursor + 1) % len(self.slots)
        return slot

    def run_layers(self, t: int, x: Any) -> Any:
        if not self.captured and self.pool is None:
            return super().run_layers(t, x)
        for layer in self.module:  # no per-microbatch seeding inside a graph: check_graphs refused randomness
            x = layer(x)
        return x

    # -- the capture -----------------------------------------------------------------------------------------------
    def capture_recorded(self) -> None:
        """Between two steps: the first step's recorded actions captured, the cached memory it left released first."""
        if self.captured or not self.slots:
            return
        torch.cuda.empty_cache()  # synchronises the device: every message of the step is in, none of the next posted
        self._capture(release=True)

    def _capture(self, release: bool = False) -> None:
        """Every action of a step captured in the first step's order into one pool; then replays only. A parameter
        that holds a gradient now (one the optimizer leaves out keeps adding to it, as in one process) is captured
        adding into it; the others' first backward writes theirs. `release`: the device may synchronise, so the
        warm-up's cached memory (a microbatch's activations, every gradient) is released before the capture too."""
        kept = {id(p) for p in self.parameters() if p.grad is not None}
        for slot in self.slots:
            slot.static = _static(slot.meta, self.device)
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._warm_up()
            if release:
                torch.cuda.empty_cache()
            for slot in self.slots:
                slot.graph = torch.cuda.CUDAGraph()
                # thread_local: the rank's other threads (copy-engine links, the watchdog) go on meanwhile; none
                # synchronises the device (at the fallback's capture a receive may be posted for a peer that is
                # capturing too).
                slot.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                failed: Exception | None = None
                try:
                    self._run_slot(slot)
                except Exception as e:  # reported in one line below
                    failed = e
                finally:
                    try:  # always ended, as torch.cuda.graph ends it: the stream leaves capture mode
                        slot.graph.capture_end()
                    except RuntimeError as e:
                        failed = failed or e
                if failed is not None:
                    raise UsageError(_capture_error(self._name(), slot, failed)) from None
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.grads = [(p, p.grad) for p in self.parameters() if p.grad is not None]
        for p in self.parameters():
            if id(p) not in kept:  # memory nothing has written yet: the first backward's replay does
                p.grad = None
        self.captured = True

    def _run_slot(self, slot: _Slot) -> None:
        if slot.kind == "F":
            inputs, target = tree_unflatten(slot.static, slot.spec)
            loss_scale, tree = slot.extra
            slot.result = super().forward(slot.mb, inputs, target, loss_scale=loss_scale, tree=tree)
            slot.tree = self.trees.pop(slot.mb, None)
        else:
            slot.result = super().backward(slot.mb, None if slot.extra else list(slot.static))

    def _warm_up(self) -> None:
        """One forward and backward of the first microbatch on the capture stream (libraries set up per stream
        there, not inside a capture), then every trace of it undone: gradients, buffers (BatchNorm's statistics)."""
        first_f = next(s for s in self.slots if s.kind == "F")
        first_b = self.index[("B", first_f.mb)]
        buffers = [b.detach().clone() for b in self.module.buffers()]
        held = [p.grad for p in self.parameters()]
        for p in self.parameters():
            p.grad = None
        self._run_slot(first_f)
        self._run_slot(first_b)
        first_f.result, first_b.result, first_f.tree = [], [], None
        with torch.no_grad():
            for b, saved in zip(self.module.buffers(), buffers):
                b.copy_(saved)
        for p, g in zip(self.parameters(), held):
            p.grad = g
        for s in first_f.static:
            if isinstance(s, torch.Tensor):
                s.grad = None


def _capture_error(stage: str, slot: _Slot, e: Exception) -> str:
    """The one line for a capture that failed: what was captured, the error's first line, the usual causes."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    head = f"PIPEFLOW_CUDA_GRAPHS=1: capturing {stage}'s {slot.kind} of microbatch {slot.mb} failed ({first}); "
    if isinstance(e, torch.OutOfMemoryError):
        return head + ("the graphs' pool holds an eager step's peak and every action's static inputs and outputs: "
                       "unset PIPEFLOW_CUDA_GRAPHS or plan with less memory per worker")
    return head + ("a layer that reads a value back to the host (.item(), a data-dependent shape), saves the random "
                   "state (activation checkpointing) or an autograd graph of the first step kept alive cannot be "
                   "captured: unset PIPEFLOW_CUDA_GRAPHS")
