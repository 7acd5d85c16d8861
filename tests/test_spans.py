"""SpanTimer on a simulated CUDA stream: a report reads only what the device has finished, without a sync."""
from __future__ import annotations

import pytest
import torch

from pipeflow.spans import SpanTimer


class FakeStream:
    """Events carry the host time they were recorded at; the device has reached `reached` ms."""

    def __init__(self) -> None:
        self.host = 0.0
        self.reached = 0.0
        self.syncs = 0
        self.created = 0
        self.stream_reads = 0  # torch.cuda.current_stream() calls
        self.stream = object()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        sim = self

        class Event:
            def __init__(self, **_: object) -> None:
                sim.created += 1
                self.at = -1.0

            def record(self, stream: object = None) -> None:
                assert stream is sim.stream, "recorded on the engine's stream, named (no lookup per event)"
                self.at = sim.host

            def query(self) -> bool:
                return self.at <= sim.reached

            def elapsed_time(self, end: Event) -> float:
                assert self.query() and end.query(), "read before the device reached it"
                return end.at - self.at

        def synchronize(*_: object) -> None:
            sim.syncs += 1
            sim.reached = sim.host

        def current_stream(*_: object) -> object:
            sim.stream_reads += 1
            return sim.stream

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)


def _steps(timer: SpanTimer, sim: FakeStream, first: int, count: int) -> None:
    for step in range(first, first + count):
        for mb in range(2):
            with timer.span("F", mb):
                sim.host += 1.0
            with timer.span("B", mb):
                sim.host += 2.0
        timer.end_step(step)


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    fake = FakeStream()
    fake.install(monkeypatch)
    return fake


def test_a_report_reads_the_finished_steps_without_a_sync(sim: FakeStream) -> None:
    timer = SpanTimer(torch.device("cuda"))
    timer.reset(0)
    syncs = sim.syncs
    _steps(timer, sim, 0, 3)  # each step 6 ms of host time: steps end at 6, 12, 18
    sim.reached = 13.0  # the device finished steps 0 and 1, not step 2
    spans, steps = timer.resolve(wait=False)
    assert sim.syncs == syncs
    assert [st for st, _, _ in steps] == [0, 1]
    assert [(s.kind, s.step) for s in spans] == [("F", 0), ("B", 0)] * 2 + [("F", 1), ("B", 1)] * 2
    assert steps[1][2] - steps[1][1] == pytest.approx(6e-3)
    # The rest comes with the next report, step 2's beginning (step 1's end, read above) included.
    _steps(timer, sim, 3, 1)
    sim.reached = sim.host
    spans, steps = timer.resolve(wait=False)
    assert [st for st, _, _ in steps] == [2, 3] and sim.syncs == syncs
    assert [s.step for s in spans] == [2] * 4 + [3] * 4
    assert steps[0][1] == pytest.approx(12e-3) and steps[1][2] == pytest.approx(24e-3)


def test_the_end_of_the_run_reads_everything_after_one_sync(sim: FakeStream) -> None:
    timer = SpanTimer(torch.device("cuda"))
    timer.reset(0)
    _steps(timer, sim, 0, 2)
    syncs = sim.syncs
    spans, steps = timer.resolve()
    assert sim.syncs == syncs + 1 and len(steps) == 2 and len(spans) == 8


def test_events_read_are_recorded_again_not_created(sim: FakeStream) -> None:
    timer = SpanTimer(torch.device("cuda"))
    timer.reset(0)
    for first in range(0, 20, 2):
        _steps(timer, sim, first, 2)
        sim.reached = sim.host
        timer.resolve(wait=False)
    assert sim.created < 30  # 2 steps of 8 spans: 18 events in flight at most, plus time zero and the open step


def test_the_stream_is_looked_up_once_a_step_not_at_every_event(sim: FakeStream) -> None:
    # Event.record() with no stream builds a Stream object per call: two per span, ~160 spans a step per
    # rank at microbatch 2 (issue 15, --trace < 1%).
    timer = SpanTimer(torch.device("cuda"))
    timer.reset(0)
    reads = sim.stream_reads
    _steps(timer, sim, 0, 3)  # 12 spans, 24 events
    assert sim.stream_reads - reads == 3
