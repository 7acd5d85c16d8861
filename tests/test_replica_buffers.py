"""Buffers a training forward updates on a replicated stage (pipeflow/replicabuffers.py): spectral_norm's power
iteration, an EMA. Each replica updates its own copy, so the forward and the parameters differ from one process's;
the stage's first replica says so once, after the first step, naming the stage and the buffers."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

from partitioner.plan import Plan
from pipeflow.replicabuffers import BufferWatch
from tests.conftest import Case, MpiRun, batched, write_plan
from tests.models import EmaLayer


def engine(layers: list[nn.Module], replicas: int, r: int = 0, start: int = 2) -> SimpleNamespace:
    """What BufferWatch reads of an Engine: stage 1, layers [start, start + len(layers)), on `replicas` ranks."""
    plan = Plan.from_json({"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 4, "workers": 1 + replicas,
                           "stages": [{"layers": [0, start], "replicas": 1, "ranks": [0]},
                                      {"layers": [start, start + len(layers)], "replicas": replicas,
                                       "ranks": list(range(1, 1 + replicas))}]})
    stage = SimpleNamespace(module=nn.Sequential(*layers), start=start)
    return SimpleNamespace(r=r, stages={1: stage}, plan=plan)


def train_twice(watch: BufferWatch, module: nn.Module) -> None:
    for _ in range(2):
        with watch.first_step():
            module(torch.randn(5, 4)).sum().backward()


def test_updated_buffers_are_named_once_on_the_first_replica(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    layers = [spectral_norm(nn.Linear(4, 4)), nn.BatchNorm1d(4), EmaLayer(4), nn.Linear(4, 4)]
    e = engine(layers, replicas=2)
    with caplog.at_level(logging.WARNING, logger="pipeflow"):
        train_twice(BufferWatch(e), e.stages[1].module)
    assert [r.getMessage() for r in caplog.records] == [
        "stage 1 (layers [2, 6)) runs on 2 replicas and its forward updates buffers (2.parametrizations.weight.0._u, "
        "2.parametrizations.weight.0._v, 4.ema): each replica updates its own copy from its share of the microbatches, "
        "so the forward differs from one process's and so can the parameters, and the saved model and checkpoints "
        "keep replica 0's (plan the stage unreplicated to train as one process)"]  # not BatchNorm's, nor 4.scale


@pytest.mark.parametrize("replicas, r", [(1, 0), (2, 1)], ids=["unreplicated", "second-replica"])
def test_silent_off_a_replicated_stages_first_replica(caplog: pytest.LogCaptureFixture, replicas: int, r: int) -> None:
    e = engine([EmaLayer(4)], replicas=replicas, r=r)
    with caplog.at_level(logging.WARNING, logger="pipeflow"):
        train_twice(BufferWatch(e), e.stages[1].module)
    assert not caplog.records


def test_a_buffer_put_in_place_of_another_counts_and_an_unchanged_one_does_not(
        caplog: pytest.LogCaptureFixture) -> None:
    class Swap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("same", torch.tensor([1.0, float("nan")]))
            self.register_buffer("moved", torch.zeros(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.same = self.same.clone()  # a new tensor, the same values (NaN too)
            self.moved = self.moved + x.detach().mean()
            return x

    e = engine([Swap(), nn.Linear(4, 4)], replicas=3, start=1)
    with caplog.at_level(logging.WARNING, logger="pipeflow"):
        train_twice(BufferWatch(e), e.stages[1].module)
    assert len(caplog.records) == 1 and "buffers (1.moved)" in caplog.records[0].getMessage()


def ema_run(d: Path, replicas: int) -> Case:
    plan = d / "plan.json"
    np_ = write_plan(plan, "1f1b", 4, [(3, replicas)] if replicas > 1 else [(2, 1), (1, 1)])
    return Case(np_, ["--model", "tests.models:ema_mlp", "--model-args", json.dumps({"samples": 32}), "--plan",
                      str(plan), "--steps", "2", "--microbatch-size", "2", "--optimizer", "sgd", "--device", "cpu"])


@pytest.mark.parametrize("replicas", [2, 1])
@batched(ema_run)
def test_pipeflow_train_warns_of_a_replicated_stages_buffers_once(mpi: MpiRun, replicas: int) -> None:
    lines = [ln for ln in mpi.proc.stderr.splitlines() if "its forward updates buffers" in ln]
    if replicas == 1:
        assert lines == []
    else:
        assert len(lines) == 1 and "stage 0 (layers [0, 3)) runs on 2 replicas" in lines[0]
        assert "(0.ema, 1.ema)" in lines[0]
