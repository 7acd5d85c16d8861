"""Plans with replicated stages (1F1B-RR) under mpirun equal single-process training."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import Case, MpiRun, batched, write_plan
from tests.reference import reference_flush

MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}
STEPS, M, B = 3, 5, 2  # m=5 is not a multiple of the replica counts: replicas get uneven shares


def replicated(d: Path, schedule: str, stages: list[tuple[int, int]]) -> Case:
    plan = d / "plan.json"
    np_ = write_plan(plan, schedule, M, stages)
    # 1f1b: every gradient all-reduced in place (reduce.py, PIPEFLOW_REDUCE_INPLACE); gpipe: the small ones bucketed
    return Case(np_, ["--model", "mlp", "--model-args", json.dumps(MLP), "--plan", str(plan),
                      "--steps", str(STEPS), "--microbatch-size", str(B), "--optimizer", "sgd", "--lr", "0.05",
                      "--dtype", "float64", "--device", "cpu", "--save", str(d / "model.pt")],
                env={"PIPEFLOW_REDUCE_INPLACE": "1"} if schedule == "1f1b" else {})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [[(2, 2), (2, 1), (2, 1)], [(3, 1), (3, 2)], [(2, 1), (4, 3)], [(6, 4)]],
                         ids=["2-1-1", "1-2", "1-3", "dp4"])
@batched(replicated)
def test_replicated_plan_equals_single_process(mpi: MpiRun, schedule, stages):
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("mlp", MLP, steps=STEPS, microbatches=M, microbatch_size=B, optimizer="sgd", lr=0.05)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)


def on_the_spot(d: Path) -> Case:
    return Case(3, ["--model", "mlp", "--model-args", json.dumps(MLP), "--steps", str(STEPS), "--microbatches",
                    str(M), "--microbatch-size", str(B), "--optimizer", "sgd", "--lr", "0.05", "--dtype", "float64",
                    "--device", "cpu", "--save", str(d / "model.pt")], env={"PIPEFLOW_LOG": "INFO"})


@batched(on_the_spot)
def test_plan_on_the_spot_equals_single_process(mpi: MpiRun):
    """No --plan: rank 0 profiles and plans for -np 3; whatever it picks trains like one process."""
    proc = mpi.proc
    assert "planned for 3 workers" in proc.stderr
    # Under this host's RAM shared by its 3 ranks (the ranks' host names gathered over MPI).
    assert re.search(r"planning on the spot under [0-9.]+ GiB per worker \(this machine's RAM, [0-9.]+ GiB, "
                     r"shared by its 3 ranks;", proc.stderr), proc.stderr
    # No --schedule: rank 0 compared every flush schedule of the kind table (--schedule auto) and says why.
    assert "--schedule auto compared:" in proc.stderr and "chose " in proc.stderr, proc.stderr
    assert re.search(r"^\s+gpipe\s", proc.stderr, re.M) and re.search(r"^\s+1f1b\s", proc.stderr, re.M)
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("mlp", MLP, steps=STEPS, microbatches=M, microbatch_size=B, optimizer="sgd", lr=0.05)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)


GLOBAL_BATCH = 8


def global_batch_on_the_spot(d: Path) -> Case:
    return Case(2, ["--model", "mlp", "--model-args", json.dumps(MLP), "--steps", str(STEPS), "--global-batch",
                    str(GLOBAL_BATCH), "--optimizer", "sgd", "--lr", "0.05", "--dtype", "float64", "--device", "cpu",
                    "--save", str(d / "model.pt")], env={"PIPEFLOW_LOG": "INFO"})


@batched(global_batch_on_the_spot)
def test_global_batch_on_the_spot_equals_single_process(mpi: MpiRun):
    """--global-batch 8 without a plan: rank 0 profiles at microbatch sizes 8, 4, 2, 1, the planner picks b and
    m = 8 / b, every rank trains with that b, and the result is single-process training on 8 samples a step."""
    proc = mpi.proc
    assert "--global-batch 8 compared:" in proc.stderr, proc.stderr
    found = re.search(r"plan: \w+, (\d+) microbatches of (\d+), stages", proc.stderr)
    assert found, proc.stderr
    m, b = int(found.group(1)), int(found.group(2))
    assert m * b == GLOBAL_BATCH
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("mlp", MLP, steps=STEPS, microbatches=m, microbatch_size=b, optimizer="sgd", lr=0.05)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)
