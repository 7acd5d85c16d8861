"""pipeflow-profile --timing stage: each layer timed inside the chain a stage runs (partitioner.measure.time_chain)."""
from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from partitioner import chain, profiler
from partitioner.chain import time_chain
from partitioner.profile import Profile, ProfileError
from pipeflow.spec import ModelSpec

SLACK_MS = 15.0  # what a sleep may overshoot on a loaded 2-core machine (a swapped layer fails the lower bound)
ATTEMPTS = 3


def retried(test: Callable[..., None]) -> Callable[..., None]:
    """Run a test of sleeps' times again when an assertion fails, at most ATTEMPTS times: on a loaded machine a sleep
    now and then overshoots by more than SLACK_MS (16.5 ms for 1 ms, once, with the suite's batches beside it); a
    time given to the wrong layer fails every attempt."""
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        for attempt in range(ATTEMPTS):
            try:
                test(*args, **kwargs)
                return
            except AssertionError:
                if attempt == ATTEMPTS - 1:
                    raise
    return run


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, backward_ms: float) -> torch.Tensor:
        ctx.backward_ms = backward_ms
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.backward_ms / 1e3)
        return g, None


LAST = {"layer": None}


class SleepLayer(nn.Module):
    """Sleeps forward_ms in its forward and backward_ms in its backward; with `cold_ms`, a forward that follows
    another layer's call sleeps that much more (what a cache that held another layer's weights costs)."""

    def __init__(self, forward_ms: float, backward_ms: float, cold_ms: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.forward_ms, self.backward_ms, self.cold_ms = forward_ms, backward_ms, cold_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cold = LAST["layer"] is not None and LAST["layer"] != id(self)
        LAST["layer"] = id(self)
        time.sleep((self.forward_ms + (self.cold_ms if cold else 0.0)) / 1e3)
        return _Sleep.apply(self.fc(x), self.backward_ms)


def _spec(layers: list[nn.Module]) -> ModelSpec:
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 4, (16,)))
    return ModelSpec(layers, nn.functional.cross_entropy, data, name="sleepy")


def _times(prof: Profile) -> list[tuple[float, float, float]]:
    return [(lay.forward_ms, lay.backward_ms, lay.backward_accumulate_ms or 0.0) for lay in prof.layers]


@retried
def test_each_layer_gets_its_own_forward_and_backward_in_the_chain() -> None:
    sleeps = [(2.0, 8.0), (4.0, 10.0), (6.0, 12.0)]
    spec = _spec([SleepLayer(f, b) for f, b in sleeps])
    prof = profiler.profile_model(spec, 2, warmup=1, repeats=2, optimizer=None, timing="stage")
    assert prof.timing == "stage"
    for (f, b), (tf, tb, ta) in zip(sleeps, _times(prof)):
        assert f <= tf < f + SLACK_MS
        assert b <= tb < b + SLACK_MS
        assert b <= ta < b + SLACK_MS


@retried
def test_a_layer_that_follows_other_layers_is_timed_as_it_runs_in_a_stage() -> None:
    # Timed alone, again and again, a layer never pays for following another; in a stage it always does.
    spec = _spec([SleepLayer(5.0, 1.0, cold_ms=20.0) for _ in range(3)])
    alone = profiler.profile_model(spec, 2, warmup=1, repeats=2, optimizer=None, timing="idle")
    staged = profiler.profile_model(spec, 2, warmup=1, repeats=2, optimizer=None, timing="stage")
    for (fa, _, _), (fs, _, _) in zip(_times(alone), _times(staged)):
        assert fa < 5.0 + SLACK_MS
        assert 25.0 <= fs < 25.0 + SLACK_MS


@retried
def test_a_model_larger_than_the_budget_is_timed_a_window_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps = [(2.0, 4.0), (6.0, 8.0), (4.0, 2.0)]
    spec = _spec([SleepLayer(f, b) for f, b in sleeps])
    windows: list[int] = []
    real = chain.time_chain

    def spy(layers: Any, *args: Any, **kw: Any) -> Any:
        windows.append(len(layers))
        return real(layers, *args, **kw)

    monkeypatch.setattr(chain, "machine_bytes", lambda dev: (800, "tiny"))  # 200 bytes: a layer per window
    monkeypatch.setattr(chain, "time_chain", spy)
    prof = profiler.profile_model(spec, 2, warmup=1, repeats=2, optimizer=None, timing="stage")
    assert windows == [1, 1, 1]
    for (f, b), (tf, tb, _) in zip(sleeps, _times(prof)):
        assert f <= tf < f + SLACK_MS
        assert b <= tb < b + SLACK_MS


class TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = x[0] if isinstance(x, tuple) else x
        return self.fc(x), self.fc(x) * 2  # the second output is unused by the next layer


class FirstOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.fc(x[0])


def test_outputs_the_next_layer_leaves_unused_get_no_backward() -> None:
    layers = [TwoOut(), FirstOnly()]
    times = time_chain(layers, torch.randn(2, 4), torch.device("cpu"), warmup=1, repeats=1)
    assert [len(f) for f in times.forward] == [2, 2] and [len(b) for b in times.backward] == [1, 1]
    assert [len(a) for a in times.accumulate] == [1, 1]
    assert len(times.passes) == 1 and not times.output.requires_grad  # the pass that did not accumulate
    assert all(p.grad is None for layer in layers for p in layer.parameters())  # left as found


def test_the_cli_writes_stage_timing_on_cpu_and_refuses_kernels_and_graphs(tmp_path: Any, capsys: Any) -> None:
    out = tmp_path / "p.json"
    args = ["--model", "mlp", "--model-args", '{"layers": 3, "hidden": 16}', "--microbatch-size", "4",
            "--warmup", "0", "--repeats", "1", "-o", str(out)]
    assert profiler.main([*args, "--timing", "stage"]) == 0
    assert json.loads(out.read_text())["timing"] == "stage"
    assert Profile.load(str(out)).timing == "stage"
    assert profiler.main([*args, "--timing", "kernels"]) == 2
    assert "--timing kernels times CUDA kernels: it needs --device cuda, found cpu" in capsys.readouterr().err
    assert profiler.main([*args, "--timing", "graphs"]) == 2
    assert "--timing graphs times CUDA kernels: it needs --device cuda, found cpu" in capsys.readouterr().err
    with pytest.raises(ProfileError, match="--timing must be one of idle, kernels, stage, graphs, found 'fast'"):
        profiler.profile_model(_spec([SleepLayer(0, 0)]), 2, timing="fast")


class Cut(nn.Module):
    """Passes its input on without a gradient path (a frozen feature extractor's end)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


@retried
def test_layers_before_a_cut_in_the_chain_have_no_backward() -> None:
    layers = [SleepLayer(1.0, 6.0), Cut(), SleepLayer(1.0, 8.0)]
    times = time_chain(layers, torch.randn(2, 4), torch.device("cpu"), warmup=0, repeats=1)
    assert times.backward[0] == [0.0] and times.backward[1] == [0.0] and times.accumulate[0] == [0.0]
    assert 8.0 <= times.backward[2][0] < 8.0 + SLACK_MS and 1.0 <= times.forward[0][0] < 1.0 + SLACK_MS


class Skip(nn.Module):
    """Returns (its own output, the skip tensor it was given or made), passing the skip through unchanged."""

    def __init__(self, make: bool) -> None:
        super().__init__()
        self.fc, self.make = nn.Linear(4, 4), make

    def forward(self, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        h, skip = (x, x) if self.make else x
        return torch.tanh(self.fc(h)), skip


class Join(nn.Module):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return x[0] + x[1]


@retried
def test_a_skip_connection_carried_through_layers_times_every_layer() -> None:
    layers = [Skip(True), Skip(False), Skip(False), Join()]
    times = time_chain(layers, torch.randn(2, 4), torch.device("cpu"), warmup=1, repeats=2)
    assert all(t >= 0.0 for per in (times.forward, times.backward, times.accumulate) for ts in per for t in ts)
    assert all(len(ts) == 2 for ts in times.backward)
    # The profiler over such a model: every layer priced, the passes consistent.
    spec = _spec([Skip(True), Skip(False), Join(), SleepLayer(1.0, 2.0)])
    prof = profiler.profile_model(spec, 2, warmup=1, repeats=1, optimizer=None, timing="stage")
    assert len(prof.layers) == 4 and all(lay.backward_ms >= 0.0 for lay in prof.layers)
    assert 2.0 <= prof.layers[3].backward_ms < 2.0 + SLACK_MS


class _SlowLoss(torch.autograd.Function):
    """Sums its input; its backward sleeps `backward_ms` before passing the gradient to the last layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, backward_ms: float) -> torch.Tensor:
        ctx.backward_ms, ctx.shape = backward_ms, x.shape
        return x.sum()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.backward_ms / 1e3)
        return g.expand(ctx.shape), None


def slow_loss(forward_ms: float, backward_ms: float) -> Any:
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(forward_ms / 1e3)
        return _SlowLoss.apply(out, backward_ms)
    return loss


def test_a_chain_that_ends_the_model_times_its_loss_apart_from_the_last_layer() -> None:
    # Sleeps long enough that a time given to the wrong owner (the loss's 60 ms, the last layer's 35) misses its
    # bounds by more than a loaded machine's overshoot (the suite's 2 cores: one pass in many overshot 15 ms).
    slack = 30.0
    layers = [SleepLayer(1.0, 2.0), SleepLayer(1.0, 35.0)]
    times = time_chain(layers, torch.randn(2, 4), torch.device("cpu"), warmup=1, repeats=1,
                       loss=(slow_loss(20.0, 40.0), torch.zeros(2)))
    assert len(times.loss) == 2  # every kept pass, accumulating or not
    assert all(60.0 <= t < 60.0 + slack for t in times.loss), times.loss
    # The last layer's backward starts when the loss's has given its outputs their gradient, not before.
    assert 35.0 <= times.backward[1][0] < 35.0 + slack and 35.0 <= times.accumulate[1][0] < 35.0 + slack, times
    assert time_chain(layers, torch.randn(2, 4), torch.device("cpu"), warmup=0, repeats=1).loss == []


@retried
def test_stage_timing_prices_the_loss_inside_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """--timing stage takes the loss's time from the last window's chain; idle keeps time_loss's (alone)."""
    monkeypatch.setattr(profiler, "time_loss", lambda *a, **k: 999.0)
    data = TensorDataset(torch.randn(16, 4), torch.zeros(16))
    spec = ModelSpec([SleepLayer(1.0, 1.0), SleepLayer(1.0, 1.0)], slow_loss(5.0, 10.0), data, name="sleepy")
    staged = profiler.profile_model(spec, 2, warmup=1, repeats=1, optimizer=None, timing="stage")
    assert staged.loss_ms is not None and 15.0 <= staged.loss_ms < 15.0 + SLACK_MS
    assert profiler.profile_model(spec, 2, warmup=1, repeats=1, optimizer=None, timing="idle").loss_ms == 999.0


PACE = {"extra_ms": 0.0}  # what a slow host adds to each forward of PacedLayer (class-wide: profiling copies layers)


class PacedLayer(SleepLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(PACE["extra_ms"] / 1e3)
        return super().forward(x)


@pytest.mark.parametrize("rounds", [1, 3])
@retried
def test_the_fastest_of_several_rounds_is_kept(monkeypatch: pytest.MonkeyPatch, rounds: int) -> None:
    """A host whose pace moves between rounds (2 x H200: 2x from second to second): --rounds R times the chain R
    times and keeps the round whose passes took least, every layer's numbers from it, its loss too."""
    real, paces, started = chain.time_chain, [20.0, 0.0, 20.0], []

    def paced(*args: Any, **kwargs: Any) -> Any:
        PACE["extra_ms"] = paces[len(started)]
        started.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(chain, "time_chain", paced)
    monkeypatch.setattr(chain, "ROUND_GAP_S", 0.05)
    data = TensorDataset(torch.randn(16, 4), torch.zeros(16))
    spec = ModelSpec([PacedLayer(1.0, 1.0), PacedLayer(1.0, 1.0)], slow_loss(2.0, 2.0), data, name="paced")
    warnings: list[str] = []
    try:
        prof = profiler.profile_model(spec, 2, warmup=1, repeats=1, optimizer=None, timing="stage", rounds=rounds,
                                      warnings=warnings)
    finally:
        PACE["extra_ms"] = 0.0
    moved = [w for w in warnings if w.startswith("the host's pace moved between the 3 timing rounds: the slowest "
                                                 "took ")]
    assert len(moved) == (rounds == 3) and all(w.endswith(
        "the fastest, which the profile keeps (warning above 1.2). Where the host sets the pace (small microbatches "
        "on a GPU), training may run slower than planned") for w in moved), warnings
    assert len(started) == rounds and all(b - a >= 0.05 for a, b in zip(started, started[1:]))
    slow = rounds == 1  # one round: the slow host's pace, as before
    for lay in prof.layers:
        assert (lay.forward_ms >= 21.0) == slow and lay.forward_ms < 1.0 + 20.0 * slow + SLACK_MS, lay
    assert prof.loss_ms is not None and 4.0 <= prof.loss_ms < 4.0 + SLACK_MS


def test_rounds_default_by_device_and_are_checked() -> None:
    assert chain.ROUNDS == {"cuda": 5, "cpu": 1}
    with pytest.raises(ProfileError, match=r"^--rounds must be >= 1, found 0$"):
        profiler.profile_model(_spec([SleepLayer(0.0, 0.0)]), 2, warmup=0, repeats=1, optimizer=None,
                               timing="stage", rounds=0)


@retried
def test_both_accumulations_are_timed_in_turn_through_the_host_s_spells(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autograd's and the GEMM's accumulation (gemm=True, as on CUDA) are timed round by round in turn, so both meet
    the host's pace of the same seconds. A slow spell over the first three chain timings: timed one way after the
    other (before), autograd's three rounds all fell in it and its times came out 20 ms slow, the GEMM's fast, and
    the planner priced autograd's plan on the slow numbers (2 x H200: forwards of 17.9 ms against 9.7)."""
    real, paces, order = chain.time_chain, [20.0, 20.0, 20.0, 0.0, 0.0, 0.0], []

    def paced(layers: Any, *args: Any, **kwargs: Any) -> Any:
        PACE["extra_ms"] = paces[len(order)]
        order.append(len(order))
        return real(layers, *args, **kwargs)

    monkeypatch.setattr(chain, "time_chain", paced)
    monkeypatch.setattr(chain, "ROUND_GAP_S", 0.0)
    data = TensorDataset(torch.randn(16, 4), torch.zeros(16))
    spec = ModelSpec([PacedLayer(1.0, 1.0), PacedLayer(1.0, 1.0)], slow_loss(2.0, 2.0), data, name="paced")
    try:
        prof = profiler.profile_model(spec, 2, warmup=1, repeats=1, optimizer=None, timing="stage", rounds=3,
                                      gemm=True)
    finally:
        PACE["extra_ms"] = 0.0
    assert len(order) == 6
    for lay in prof.layers:
        assert lay.forward_gemm_ms is not None
        assert lay.forward_ms < 1.0 + SLACK_MS and lay.forward_gemm_ms < 1.0 + SLACK_MS, lay
