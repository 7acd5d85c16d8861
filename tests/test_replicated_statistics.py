"""BatchNorm's running statistics in a replicated stage (pipeflow/planning.py, replicated_statistics): each replica
keeps its own, from its share of the microbatches, so the saved buffers are not one process's; the run says so in
one warning, and stays silent where they are one process's."""
from __future__ import annotations

import torch
from torch import nn

from partitioner.plan import Plan
from pipeflow.planning import replicated_statistics
from pipeflow.spec import ModelSpec


class Norm(nn.Module):
    def __init__(self, track: bool = True) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=track)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


def spec(*layers: nn.Module) -> ModelSpec:
    return ModelSpec(layers=list(layers), loss_fn=nn.functional.cross_entropy, dataset=[])  # type: ignore[arg-type]


def plan(stages: list[tuple[int, int, int]]) -> Plan:
    """(start, end, replicas) per stage, ranks in order."""
    out, rank = [], 0
    for a, b, r in stages:
        out.append({"layers": [a, b], "replicas": r, "ranks": list(range(rank, rank + r))})
        rank += r
    return Plan.from_json({"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 4, "workers": rank,
                           "stages": out})


def test_a_replicated_stage_with_running_statistics_is_named_with_its_modules() -> None:
    model = spec(nn.Linear(4, 4), Norm(), nn.BatchNorm1d(4), nn.Linear(4, 3))
    assert replicated_statistics(model, plan([(0, 1, 1), (1, 4, 2)])) == (
        "stage 1 (layers [1, 4)) runs on 2 replicas and keeps running statistics (1.bn, 2): each replica updates "
        "its own from its share of the microbatches, as DDP without SyncBatchNorm, and the saved model and "
        "checkpoints keep replica 0's; the parameters train as in one process, those buffers do not (plan the "
        "stage unreplicated to keep them too)")


def test_no_warning_without_replicas_or_without_tracked_statistics() -> None:
    model = spec(Norm(), Norm(), nn.Linear(4, 3))
    assert replicated_statistics(model, plan([(0, 2, 1), (2, 3, 1)])) is None  # a pipeline: one process's
    assert replicated_statistics(model, plan([(0, 2, 1), (2, 3, 2)])) is None  # the replicated stage has none
    untracked = spec(Norm(track=False), nn.Linear(4, 3))
    assert replicated_statistics(untracked, plan([(0, 2, 2)])) is None  # normalised by the batch alone
    layer_norm = spec(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    assert replicated_statistics(layer_norm, plan([(0, 3, 2)])) is None
