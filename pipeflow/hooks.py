"""The engine's hooks, as small Protocols given to its constructor (issue 12: nothing outside the engine
assigns its attributes): a `Feed` gives it microbatches, `Timing` measures spans of its work (the
monitor's SpanTimer, spans.py), a `StepGate` decides at every STEP whether the optimizer update is
applied (guard.StepGuard), and `WeightHooks` swap weight versions around each action (stash.StashPolicy) or, at
the start of an action list, capture CUDA graphs (graphs.CaptureAtStep).
Each has a default that does nothing, and none of their implementations needs to import the engine."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Feed(Protocol):
    """The engine's data: microbatch j (a global index: step * m + i) as (inputs, target), and the shapes
    of its inputs, which every rank knows without the data travelling (data.loader.MicrobatchLoader,
    api.BatchFeed)."""

    def microbatch(self, j: int) -> tuple[Any, Any]: ...
    def signature(self, j: int) -> tuple[tuple[int, ...], ...]: ...


@runtime_checkable
class Timing(Protocol):
    """Measures spans of the engine's work: `with timing.span("F", mb): ...` around each action."""

    def span(self, kind: str, mb: int | None = None) -> AbstractContextManager[None]: ...


class Timer:
    """The default Timing: measures nothing."""

    def span(self, kind: str, mb: int | None = None) -> contextlib.AbstractContextManager[None]:
        return _NOTHING  # one shared no-op context: measuring nothing costs nothing per span


_NOTHING = contextlib.nullcontext()


@runtime_checkable
class StepGate(Protocol):
    """Called at every STEP, after the gradients are final and before the optimizer: returns whether to
    apply the update. A gate may instead arm the optimizer to skip on the device (`arm_device_skip`) and
    return True: the update then skips itself without a host sync (guard.StepGuard on GPUs)."""

    def __call__(self) -> bool: ...


# What the engine's constructor takes for a gate: a function of the engine (made once the engine knows
# its stage, optimizer and actions, which a gate checks), so that no one sets a gate on an engine.
GateFactory = Callable[[Any], StepGate]


@runtime_checkable
class WeightHooks(Protocol):
    """Which weights a microbatch's forward and backward use, swapped around each action; `begin_actions` at the start
    of each action list the engine runs (a flush schedule's step), before any of its messages is posted."""

    def begin_actions(self) -> None: ...
    def before_forward(self, mb: int) -> None: ...
    def after_forward(self, mb: int) -> None: ...
    def before_backward(self, mb: int) -> None: ...
    def after_backward(self, mb: int) -> None: ...
    def before_step(self) -> None: ...
    def after_step(self) -> None: ...
    def finish(self) -> None: ...


class WeightPolicy:
    """The default WeightHooks. Flush schedules (gpipe, 1f1b) use the current weights throughout;
    asynchronous schedules (stash.py's StashPolicy, a subclass) swap versions around each action."""

    def begin_actions(self) -> None: ...
    def before_forward(self, mb: int) -> None: ...
    def after_forward(self, mb: int) -> None: ...
    def before_backward(self, mb: int) -> None: ...
    def after_backward(self, mb: int) -> None: ...
    def before_step(self) -> None: ...
    def after_step(self) -> None: ...
    def finish(self) -> None: ...


def supports_device_skip(optimizer: Any) -> bool:
    """Whether `optimizer` skips its own update when given a non-zero `found_inf` tensor: torch's fused
    optimizers do, as torch.amp.GradScaler drives them (it reads this same class attribute). The one
    place pipeflow reads that torch-private flag."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def arm_device_skip(optimizer: Any, found_inf: Any) -> None:
    """Make the next `optimizer.step()` skip on the device where `found_inf` (a 0-d float tensor) is
    non-zero, as GradScaler does: the optimizer reads its `found_inf` attribute in step()."""
    optimizer.found_inf = found_inf
