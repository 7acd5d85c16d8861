"""A stage without parameters (activations only): it trains, replicated or not, under flush and asynchronous
schedules, and its checkpoint resumes; torch.optim refuses an empty parameter list, so before this it stopped
with that traceback (pipeflow/update.py, optimizer_over)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeflow.update import optimizer_over
from tests.conftest import Case, MpiRun, batched
from tests.reference import reference_delayed
from tests.test_seams_grads import SMALL, B, assert_same, reference, saved, train

MODEL = "tests.models_grads:activations"
OPT = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01"]


def test_a_rank_without_parameters_gets_an_optimizer_that_updates_nothing() -> None:
    opt = optimizer_over(lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1), [], torch.device("cpu"))
    (placeholder,) = opt.param_groups[0]["params"]
    assert placeholder.numel() == 0 and not placeholder.requires_grad
    opt.step()
    assert opt.state_dict()["state"] == {}


def flush_and_resume(d: Path) -> list[Case]:
    ck = ["--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "1"]
    whole = train(d, MODEL, SMALL, [(1, 1), (2, 2), (1, 1)], schedule="1f1b", m=4, steps=3, extra=OPT)
    first = train(d, MODEL, SMALL, [(1, 1), (2, 2), (1, 1)], schedule="1f1b", m=4, steps=2, extra=OPT + ck,
                  name="first.pt")
    resumed = train(d, MODEL, SMALL, [(1, 1), (2, 2), (1, 1)], schedule="1f1b", m=4, steps=3,
                    extra=OPT + ck + ["--resume"], name="resumed.pt")
    return [whole, first, resumed]


@batched(flush_and_resume)
def test_a_replicated_stage_of_activations_trains_and_resumes(mpi: MpiRun) -> None:
    want = reference(MODEL, SMALL, steps=3, microbatches=4, optimizer="adamw", lr=0.01, weight_decay=0.01)
    assert_same(saved(mpi), want)
    assert_same(saved(mpi, "resumed.pt"), saved(mpi))


def asynchronous(d: Path, schedule: str) -> Case:
    return train(d, MODEL, SMALL, [(1, 1), (2, 1), (1, 1)], schedule=schedule, m=4, steps=3, extra=OPT)


@pytest.mark.parametrize("schedule", ["async", "2bw"])
@batched(asynchronous)
def test_a_stage_of_activations_under_the_asynchronous_schedules(mpi: MpiRun, schedule: str) -> None:
    want = reference_delayed(MODEL, SMALL, schedule=schedule, stages=[(1, 1), (2, 1), (1, 1)], steps=3,
                             microbatches=4, microbatch_size=B, optimizer="adamw", lr=0.01)  # weight decay 0.01
    assert_same(saved(mpi), want)
