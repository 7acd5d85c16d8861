"""Parameters frozen and unfrozen between the steps of a user's loop train as in one process (pipeflow/trainable.py):
on a replicated stage, with clipping, with a stage frozen whole, under 2bw and async; refused in one line where the
optimizer state is sharded."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeflow.structure import shape_change
from pipeflow.trainable import CHANGED, GRAPHED, SHARDED, refusal
from tests import api_freeze_loop
from tests.conftest import Case, MpiRun, batched, write_plan

MAIN = "tests.api_freeze_loop:main"
# name -> (-np, schedule, plan stages as (layers, replicas) or None for the even split)
SETUPS = {"replicated-1f1b": (3, "1f1b", [(2, 2), (2, 1)]), "straight-2bw": (2, "2bw", None),
          "replicated-gpipe": (3, "gpipe", [(2, 1), (2, 2)])}


def loop(d: Path, name: str) -> Case:
    np, schedule, stages = SETUPS[name]
    plan = "-"
    if stages is not None:
        write_plan(d / "plan.json", schedule, 4, stages)
        plan = str(d / "plan.json")
    return Case(np, [str(d / "out"), schedule, plan], main=MAIN)


@pytest.mark.parametrize("name", list(SETUPS))
@batched(loop)
def test_freezing_and_unfreezing_between_steps_trains_as_one_process(mpi: MpiRun, name: str) -> None:
    """Before: an unfrozen parameter of a replicated stage was never all-reduced (the replicas drifted apart, weights
    off by 2e-2), the global norm left it out (off by 1e-3), freezing one stopped the backward ("cannot register a
    hook on a tensor that doesn't require gradient"), and freezing a first stage whole stopped the run with a shape
    error."""
    want, want_norms = api_freeze_loop.reference()
    got = torch.load(mpi.dir / "out" / "model.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14, msg=f"{name}: {k}")
    torch.testing.assert_close(torch.tensor(json.loads((mpi.dir / "out" / "norms.json").read_text())),
                               torch.tensor(want_norms), rtol=1e-12, atol=0)


def async_pair(d: Path) -> list[Case]:
    """The same async training twice: layers frozen by requires_grad, and frozen by a step's lr of 0 (plain SGD)."""
    return [Case(2, [str(d / "frozen"), "async", "-"], main=MAIN), Case(2, [str(d / "lr0"), "async", "-", "lr0"],
                                                                       main=MAIN)]


@batched(async_pair)
def test_freezing_under_async_equals_a_learning_rate_of_zero(mpi: MpiRun) -> None:
    """Under async the stashed weight copies are reused from step to step: one made while a layer was frozen kept
    requires_grad False, and the microbatches that ran on it gave the unfrozen layer no gradient."""
    frozen = torch.load(mpi.dir / "frozen" / "model.pt", weights_only=True)
    lr0 = torch.load(mpi.dir / "lr0" / "model.pt", weights_only=True)
    for k in lr0:
        torch.testing.assert_close(frozen[k], lr0[k], rtol=1e-12, atol=1e-14, msg=k)


def sharded(d: Path) -> Case:
    write_plan(d / "plan.json", "1f1b", 4, [(2, 2), (2, 1)])
    return Case(3, [str(d / "out"), "1f1b", str(d / "plan.json"), "shard"], main=MAIN)


@batched(sharded)
def test_a_change_on_a_sharded_stage_is_refused_on_every_rank(mpi: MpiRun) -> None:
    errors = [(mpi.dir / "out" / f"error-rank{r}.txt").read_text() for r in range(3)]
    assert errors == [errors[0]] * 3, errors
    assert errors[0] == (
        "Pipeline.step: requires_grad changed since the last step on rank 0 (stage 0), whose optimizer state is "
        "sharded over its replicas (shard_optimizer): each owns a share of the trainable parameters chosen when the "
        "Pipeline was built; freeze or unfreeze before building it, or build it without shard_optimizer")


def test_refusal_names_the_first_rank_that_cannot_follow() -> None:
    stages = [0, 0, 1, 1]
    assert refusal([CHANGED, 0, CHANGED, 0], stages) is None
    assert refusal([SHARDED, 0, 0, 0], stages) is None  # sharded, but nothing changed there
    assert "on rank 1 (stage 0)" in str(refusal([0, CHANGED | SHARDED, CHANGED, 0], stages))
    graphed = refusal([0, 0, 0, CHANGED | GRAPHED], stages)
    assert graphed is not None and "after the first step on rank 3 (stage 1), under PIPEFLOW_CUDA_GRAPHS=1" in graphed


def test_a_boundary_that_changed_only_in_requires_grad_is_named_so() -> None:
    """The message showed the same shapes twice and blamed them."""
    before = ([((2, 6), torch.float32, True)], None)
    now = ([((2, 6), torch.float32, False)], None)
    assert str(shape_change(1, before, now, ((2, 4),))) == (
        "the tensors sent to rank 1 changed from [(2, 6) float32 requiring grad] to [(2, 6) float32] for inputs of the "
        "same shapes ((2, 4),): whether they require grad must not change between microbatches of one step (a stage's "
        "output detached for some only); between the steps of your own loop, Pipeline follows a change of "
        "requires_grad")
