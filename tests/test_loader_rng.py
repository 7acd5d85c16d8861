"""A dataset that draws random numbers in __getitem__ (noise, masks, crops) gives every rank the same samples: the first
stage reads the inputs and the last the targets, each from its own generators, so with two stages a denoising model
trained on noise its last stage never saw (the loss stayed at the noise's variance), and the run depended on the
plan (pipeflow/data/loader.py)."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from pipeflow.data.loader import MicrobatchLoader
from pipeflow.models import mlp
from pipeflow.spec import ModelSpec
from tests.conftest import Case, MpiRun, batched


class Noisy(Dataset):  # type: ignore[type-arg]
    """x plus fresh noise from torch, numpy and Python at every read; the target is the noise's class."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(self.x.shape[1], dtype=self.x.dtype) + float(np.random.rand()) + random.random()
        return self.x[i] + noise, (noise > 0).long()[0]


def noisy_mlp(**kw: Any) -> ModelSpec:
    spec = mlp.build(**kw)
    spec.dataset = Noisy(spec.dataset.tensors[0])  # type: ignore[attr-defined]
    return spec


def test_a_microbatch_s_random_draws_depend_on_the_seed_and_its_index_alone() -> None:
    want = MicrobatchLoader(Noisy(torch.zeros(64, 3)), 4, seed=1).microbatch(5)
    torch.manual_seed(123)  # another rank's generators, elsewhere in its work
    np.random.seed(7)
    random.seed(9)
    staged = MicrobatchLoader(Noisy(torch.zeros(64, 3)), 4, seed=1)
    staged.stage_on(torch.device("cpu"), 3)
    staged.signature(5)  # reads a sample too
    for got in (staged.microbatch(5), MicrobatchLoader(Noisy(torch.zeros(64, 3)), 4, seed=1).microbatch(5)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    other = MicrobatchLoader(Noisy(torch.zeros(64, 3)), 4, seed=1).microbatch(6)[0]
    assert not torch.equal(other, want[0])


ARGS = ["--model", "tests.test_loader_rng:noisy_mlp", "--model-args",
        json.dumps({"layers": 4, "d_in": 8, "hidden": 16, "classes": 2, "samples": 64}), "--microbatches", "4",
        "--microbatch-size", "2", "--device", "cpu", "--dtype", "float64", "--steps", "3", "--optimizer", "sgd"]


def one_and_two_stages(d: Path) -> list[Case]:
    return [Case(1, [*ARGS, "--save", str(d / "one.pt")]),
            Case(2, [*ARGS, "--layers-per-stage", "even", "--save", str(d / "two.pt")])]


@batched(one_and_two_stages)
def test_a_noisy_dataset_trains_the_same_on_one_rank_and_on_two_stages(mpi: MpiRun) -> None:
    one = torch.load(mpi.dir / "one.pt", weights_only=True)
    two = torch.load(mpi.dir / "two.pt", weights_only=True)
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-12, atol=1e-14, msg=k)
