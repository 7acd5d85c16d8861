"""Measured spans of the engine's work (the monitor's Timer) and the per-step times and bubble they give."""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

COMPUTE = ("F", "B", "W")  # what counts as work in the bubble; everything else is waiting or overhead
CATEGORY = {"F": "compute", "B": "compute", "W": "compute", "STEP": "optimizer", "SEND_F": "comm", "SEND_B": "comm",
            "WAIT_F": "comm", "WAIT_B": "comm"}


@dataclass
class Span:
    """One measured action, in seconds since the monitor's zero (the barrier at start, common to all ranks)."""

    kind: str
    mb: int | None
    step: int
    start: float
    end: float


class SpanTimer:
    """Records every span of the engine (a hooks.Timing). On CPU, host perf_counter; on CUDA, a pair of
    events on the current stream, turned into times only in `resolve` (at report time), so the steady state
    never syncs the host."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.step = 0
        self.t0 = time.perf_counter()
        self.ref: Any = None  # CUDA: the event that marks time zero
        self._spans: list[tuple[str, int | None, int, Any, Any]] = []
        self._steps: list[tuple[int, Any, Any]] = []  # (step, begin, end), unresolved
        self._spans_at: list[int] = []  # per unresolved step: how many spans were recorded by its end
        self._free: list[Any] = []  # CUDA events whose times were read (resolve): recorded again, not recreated
        # The stream the engine computes on, read once per step: Event.record() without one builds a Stream
        # object per call (two per span, hundreds a step at microbatch 2).
        self._stream: Any = torch.cuda.current_stream(device) if self.cuda else None
        self._begin: Any = self._now()

    def _now(self) -> Any:
        if self.cuda:
            ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
            ev.record(self._stream)
            return ev
        return time.perf_counter()

    def _seconds(self, mark: Any) -> float:
        return float(self.ref.elapsed_time(mark)) / 1e3 if self.cuda else mark - self.t0

    def reset(self, step: int = 0) -> None:
        """Time zero is now (call right after a barrier) and `step` comes next; drops anything recorded."""
        if self.cuda:
            torch.cuda.synchronize()  # once, at start: the zero event then runs when the host says
            self._stream = torch.cuda.current_stream()
        self.t0 = time.perf_counter()
        self.ref = self._now()
        self._spans.clear()
        self._steps.clear()
        self._spans_at.clear()
        self.step = step
        self._begin = self._now()

    def span(self, kind: str, mb: int | None = None) -> _Recording:
        return _Recording(self, kind, mb)

    def end_step(self, step: int) -> None:
        """Step `step` ends now; it began where the previous one ended, so a stage's step time is its period
        (what throughput sees), the monitor's own report time included as idle."""
        end = self._now()
        if self.cuda:
            self._stream = torch.cuda.current_stream()
        self._steps.append((step, self._begin, end))
        self._spans_at.append(len(self._spans))
        self._begin = end
        self.step = step + 1

    def skip(self) -> None:
        """The time until now belongs to no step (an evaluation between steps): the next step begins now."""
        self._begin = self._now()

    def resolve(self, *, wait: bool = True) -> tuple[list[Span], list[tuple[int, float, float]]]:
        """The spans and step intervals recorded since the last call, in seconds. With `wait` (the end of a
        run) all of them, syncing the device on CUDA. Without (a report in the steady state), on CUDA only the
        steps whose end the device has reached and the spans recorded before that end, read without a sync:
        a sync at every report drained the device's queue on ranks that otherwise never wait for it (issue 15,
        --trace < 1%); the rest comes at the next call."""
        n_steps, n_spans = len(self._steps), len(self._spans)
        if self.cuda and wait:
            torch.cuda.synchronize()
        elif self.cuda:
            n_steps = 0
            for _, _, end in self._steps:  # recorded in order on one stream: they complete in order
                if not end.query():
                    break
                n_steps += 1
            n_spans = self._spans_at[n_steps - 1] if n_steps else 0
            if not all(b.query() for *_, b in self._spans[:n_spans]):  # a span on another stream, still running
                torch.cuda.synchronize()
        spans = [Span(k, mb, st, self._seconds(a), self._seconds(b)) for k, mb, st, a, b in self._spans[:n_spans]]
        steps = [(st, self._seconds(a), self._seconds(b)) for st, a, b in self._steps[:n_steps]]
        if self.cuda:  # the events read go back to the pool, but those still in use (an open step's beginning,
            # time zero, the events of what is left for the next call)
            left = {id(e) for *_, a, b in self._spans[n_spans:] for e in (a, b)}
            left.update(id(e) for _, a, b in self._steps[n_steps:] for e in (a, b))
            left.update((id(self._begin), id(self.ref)))
            done = {id(e): e for *_, a, b in self._spans[:n_spans] for e in (a, b)}
            done.update((id(e), e) for _, a, b in self._steps[:n_steps] for e in (a, b))
            self._free += [e for k, e in done.items() if k not in left]
        del self._spans[:n_spans], self._steps[:n_steps], self._spans_at[:n_steps]
        self._spans_at[:] = [n - n_spans for n in self._spans_at]
        return spans, steps


class _Recording:
    """The context of one span: two marks (host times, or CUDA events on the current stream, never a sync).
    A plain class, not a generator: entering and leaving cost a few attribute stores (--trace < 1%)."""

    __slots__ = ("timer", "kind", "mb", "start")

    def __init__(self, timer: SpanTimer, kind: str, mb: int | None) -> None:
        self.timer, self.kind, self.mb = timer, kind, mb

    def __enter__(self) -> None:
        self.start = self.timer._now()

    def __exit__(self, *exc: object) -> None:
        t = self.timer
        t._spans.append((self.kind, self.mb, t.step, self.start, t._now()))


def step_metrics(spans: list[Span], begin: float, end: float) -> dict[str, float]:
    """Per-step times (ms) of one rank from its spans; idle is what is neither compute nor comm wait."""
    ms = {k: 0.0 for k in CATEGORY}
    for s in spans:
        ms[s.kind] = ms.get(s.kind, 0.0) + (s.end - s.start) * 1e3
    wall = max((end - begin) * 1e3, 1e-9)
    compute = sum(ms[k] for k in COMPUTE)
    wait = ms["WAIT_F"] + ms["WAIT_B"]
    # A split backward (zero bubble) counts its B and W as the backward.
    return {"time/forward_ms": ms["F"], "time/backward_ms": ms["B"] + ms["W"], "time/comm_wait_ms": wait,
            "time/optimizer_ms": ms["STEP"], "time/idle_ms": max(wall - compute - wait, 0.0),
            "time/step_ms": wall, "pipeline/bubble_fraction": min(max(1.0 - compute / wall, 0.0), 1.0)}


def window_metrics(spans: list[Span], steps: list[tuple[int, float, float]]) -> dict[str, float]:
    """The mean of step_metrics over the steps of one report window."""
    by_step: dict[int, list[Span]] = {}
    for s in spans:
        by_step.setdefault(s.step, []).append(s)
    rows = [step_metrics(by_step.get(k, []), b, e) for k, b, e in steps]
    return {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]} if rows else {}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB
