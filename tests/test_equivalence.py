"""gpipe, 1f1b, zb and zb-h2 under mpirun equal single-process training, parameter by parameter."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import Case, MpiRun, batched
from tests.reference import reference_flush

MODELS = {"mlp": {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256},
          "gpt": {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256}}
STEPS, M, B = 3, 4, 2


def pipeline(d: Path, model: str, schedule: str, np_: int) -> Case:
    return Case(np_, ["--model", model, "--model-args", json.dumps(MODELS[model]), "--schedule", schedule,
                      "--layers-per-stage", "even",
                      "--steps", str(STEPS), "--microbatches", str(M), "--microbatch-size", str(B),
                      "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--dtype", "float64",
                      "--device", "cpu", "--save", str(d / "model.pt")])


# zb and zb-h2 on 4 ranks (with replicas, a tie and dropout) are in tests/test_zerobubble_mpi.py.
@pytest.mark.parametrize("model,schedule,np_", [(m, s, n) for m in ("mlp", "gpt")
                                                for s in ("gpipe", "1f1b", "zb", "zb-h2")
                                                for n in (2, 4) if n == 2 or not s.startswith("zb")])
@batched(pipeline)
def test_pipeline_equals_single_process(mpi: MpiRun, model, schedule, np_):
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush(model, MODELS[model], steps=STEPS, microbatches=M, microbatch_size=B,
                           optimizer="sgd", lr=0.05, momentum=0.9)
    assert list(got) == list(want)
    initial = reference_flush(model, MODELS[model], steps=0, microbatches=M, microbatch_size=B)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)
    # The run trained: some parameter moved away from its initial value.
    assert any(not torch.equal(want[k], initial[k]) for k in want)


def deeper_warmup(d: Path) -> Case:
    return Case(4, ["--model", "gpt", "--model-args", json.dumps(MODELS["gpt"]), "--schedule", "1f1b",
                    "--layers-per-stage", "even", "--warmup", "fill", "--steps", str(STEPS), "--microbatches", str(M),
                    "--microbatch-size", str(B),
                    "--optimizer", "sgd", "--lr", "0.05", "--dtype", "float64", "--device", "cpu",
                    "--save", str(d / "model.pt")])


@batched(deeper_warmup)
def test_1f1b_with_deeper_warmup_equals_single_process(mpi: MpiRun):
    """--warmup fill changes only when backwards run, not what they compute."""
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("gpt", MODELS["gpt"], steps=STEPS, microbatches=M, microbatch_size=B, optimizer="sgd",
                           lr=0.05)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)


def plan_warmup(d: Path) -> Case:
    """A plan.json naming a warm-up deeper than DAPPLE's minimum (3, 2, 1, 0), as pipeflow-plan writes one."""
    plan = {"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": M, "workers": 4, "warmup": [4, 3, 2, 0],
            "stages": [{"layers": [k, k + 1], "replicas": 1, "ranks": [k]} for k in range(4)]}
    (d / "plan.json").write_text(json.dumps(plan))
    return Case(4, ["--model", "gpt", "--model-args", json.dumps(MODELS["gpt"]), "--plan", str(d / "plan.json"),
                    "--steps", str(STEPS), "--microbatch-size", str(B), "--optimizer", "sgd", "--lr", "0.05",
                    "--dtype", "float64", "--device", "cpu", "--save", str(d / "model.pt")],
                env={"PIPEFLOW_LOG": "INFO"})


@batched(plan_warmup)
def test_1f1b_runs_the_plans_warm_up_and_equals_single_process(mpi: MpiRun):
    assert "1f1b warm-up: 4, 3, 2, 0 forwards before the first backward per stage (the plan's)" in mpi.proc.stderr
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("gpt", MODELS["gpt"], steps=STEPS, microbatches=M, microbatch_size=B, optimizer="sgd",
                           lr=0.05)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)


FINE = {**MODELS["gpt"], "granularity": "fine"}  # 10 layers: embedding, 2 x (AttentionCore, Projection, Expand,
# Contract), head


def fine_cuts(d: Path) -> Case:
    """gpt's fine layers cut where a boundary carries two tensors (the residual and the branch): after
    AttentionCore (stage 0 -> 1 and 2 -> 3) and after Expand, whose branch is four times the width."""
    plan = {"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": M, "workers": 4,
            "stages": [{"layers": list(r), "replicas": 1, "ranks": [k]}
                       for k, r in enumerate([(0, 2), (2, 4), (4, 6), (6, 10)])]}
    (d / "plan.json").write_text(json.dumps(plan))
    return Case(4, ["--model", "gpt", "--model-args", json.dumps(FINE), "--plan", str(d / "plan.json"),
                    "--steps", str(STEPS), "--microbatch-size", str(B), "--optimizer", "sgd", "--lr", "0.05",
                    "--dtype", "float64", "--device", "cpu", "--save", str(d / "model.pt")])


@batched(fine_cuts)
def test_1f1b_cut_inside_a_sublayer_equals_single_process(mpi: MpiRun):
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("gpt", FINE, steps=STEPS, microbatches=M, microbatch_size=B, optimizer="sgd", lr=0.05)
    assert list(got) == list(want) and "4.out.weight" in want  # layer 4 is the first block's Contract
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)
