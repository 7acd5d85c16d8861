"""The engine's hook interfaces, apart so that their implementations need not import the engine: the Timer
the monitor's SpanTimer subclasses (spans.py) and the WeightPolicy stash.py's StashPolicy subclasses."""
from __future__ import annotations

import contextlib


class Timer:
    """Measures spans of the engine's work; the monitor subclasses it. The default measures nothing."""

    def span(self, kind: str, mb: int | None = None) -> contextlib.AbstractContextManager[None]:
        return _NOTHING  # one shared no-op context: measuring nothing costs nothing per span


_NOTHING = contextlib.nullcontext()


class WeightPolicy:
    """Which weights a microbatch's forward and backward use. Flush schedules (gpipe, 1f1b) use the
    current weights throughout; asynchronous schedules (stash.py) swap versions around each action."""

    def before_forward(self, mb: int) -> None: ...
    def after_forward(self, mb: int) -> None: ...
    def before_backward(self, mb: int) -> None: ...
    def after_backward(self, mb: int) -> None: ...
    def before_step(self) -> None: ...
    def after_step(self) -> None: ...
    def finish(self) -> None: ...
