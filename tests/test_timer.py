"""partitioner.measure.Timer on CUDA, against a simulated device (this machine has none): by default from an
idle device (pipeflow-profile's timing); held, the kernels back to back, the hold growing to cover the launches,
and a callable that waits for the device falls back to timing from an idle device."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from partitioner import measure
from partitioner.measure import Timer


class FakeCuda:
    """One stream in ms: kernels start when launched and the stream is free; the host pays each launch."""

    def __init__(self) -> None:
        self.host = 0.0
        self.free = 0.0  # when the stream's last kernel ends

    def launch(self, device_ms: float, host_ms: float) -> None:
        self.host += host_ms
        self.free = max(self.free, self.host) + device_ms

    def sync(self, *_: object) -> None:
        self.host = max(self.host, self.free)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        sim = self

        class Event:
            def __init__(self, **_: object) -> None:
                self.at = 0.0

            def record(self) -> None:
                self.at = max(sim.free, sim.host)

            def elapsed_time(self, end: Event) -> float:
                return end.at - self.at

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", self.sync)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: self.launch(cycles / Timer.CLOCK_HZ * 1e3, 0.0))
        # measure's own clock only, not the time module's (other threads read it: conftest.in_background)
        monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: self.host / 1e3))


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    fake.install(monkeypatch)
    return fake


def test_kernels_back_to_back_not_the_launch_gaps(sim: FakeCuda) -> None:
    """Five small kernels slower to launch than to run, then a long one: the kernels take 2.5 ms back to
    back; timed from an idle device the device waits for each launch (3.1 ms)."""
    def layer() -> None:
        for _ in range(5):
            sim.launch(0.1, 0.2)
        sim.launch(2.0, 0.0)

    assert Timer(torch.device("cuda"), held=False)(layer) == pytest.approx(3.1)
    assert Timer(torch.device("cuda"))(layer) == pytest.approx(3.1)  # pipeflow-profile's default
    timer = Timer(torch.device("cuda"), held=True)
    assert timer(layer) == pytest.approx(2.5) and timer.host_ms == pytest.approx(1.0)


def test_a_host_bound_call_costs_its_kernels(sim: FakeCuda) -> None:
    """The host's launch time is not counted (on an H100 it read 2x the host's share of a running stage): a
    host-bound call is priced at its kernels."""
    timer = Timer(torch.device("cuda"), held=True)
    assert timer(lambda: [sim.launch(0.1, 0.5) for _ in range(6)]) == pytest.approx(0.6)
    assert timer.host_ms == pytest.approx(3.0)


def test_launches_longer_than_the_hold_make_the_next_hold_longer(sim: FakeCuda) -> None:
    """15 ms of launches outlast the first 10 ms hold: that call counts the gaps (a backward cannot be run
    twice to retry it), the next one is held long enough to time the kernels back to back."""
    calls = []

    def fast_device() -> None:
        calls.append(1)
        for _ in range(10):
            sim.launch(0.2, 1.5)
        sim.launch(20.0, 0.0)
    timer = Timer(torch.device("cuda"), held=True)
    assert timer(fast_device) == pytest.approx(35.2 - 10.0)  # the launches after the hold's end wait for the host
    assert len(calls) == 1 and timer.hold_ms == pytest.approx(45.0)
    assert timer(fast_device) == pytest.approx(22.0)  # 22 ms of device time against 15 ms of launches
    assert Timer(torch.device("cuda"), held=False)(fast_device) == pytest.approx(35.2)  # 15.2 of gaps, launches
    assert len(calls) == 3


def test_a_sync_inside_falls_back_to_timing_from_idle(sim: FakeCuda) -> None:
    """The host waits for the device mid-call (a .item(), say): the hold would be timed as the host's, so the
    call is timed from an idle device, as a stage would run it."""
    def layer() -> None:
        sim.launch(1.0, 0.1)
        sim.sync()
        sim.launch(1.0, 0.1)
    timer = Timer(torch.device("cuda"), held=True)
    for _ in range(4):  # the holds grow to the longest, which the host still waits out
        timer(layer)
    assert timer.hold_ms == Timer.MAX_HOLD_MS and not timer.held
    assert timer(layer) == pytest.approx(Timer(torch.device("cuda"), held=False)(layer)) == pytest.approx(2.2)
