"""A stage without parameters (activations only): it trains, replicated or not, under flush and asynchronous
schedules, and its checkpoint resumes; torch.optim refuses an empty parameter list, so before this it stopped
with that traceback (pipeflow/update.py, optimizer_over)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeflow.update import optimizer_over
from tests.conftest import Case, MpiRun, batched, write_plan
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


def first_stage_of_an_activation(d: Path) -> list[Case]:
    """No --dtype: the float64 model's float32 inputs, cast by one process, and by a first stage of its ReLU alone."""
    def run(stages: list[tuple[int, int]], name: str) -> Case:
        plan = d / f"plan-{name}.json"
        np_ = write_plan(plan, "1f1b", 4, stages)
        return Case(np_, ["--model", "tests.models_grads:float64_after_activation", "--plan", str(plan), "--steps",
                          "3", "--microbatch-size", "2", "--device", "cpu", "--save", str(d / name), *OPT])
    return [run([(4, 1)], "one.pt"), run([(1, 1), (3, 1)], "split.pt")]


@batched(first_stage_of_an_activation)
def test_a_first_stage_without_parameters_casts_inputs_to_the_model_s_dtype(mpi: MpiRun) -> None:
    """It kept them float32: the ReLU ran in float32 and the weights differed from one process's by 2e-9 (a layer
    that does not cast its own input stopped the run with "mat1 and mat2 must have the same dtype")."""
    one, split = saved(mpi, "one.pt"), saved(mpi, "split.pt")
    assert one.keys() == split.keys() and all(torch.equal(one[k], split[k]) for k in one)
