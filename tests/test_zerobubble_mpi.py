"""zb and zb-h2 under mpirun equal single-process training in float64 (flush schedules: gradients identical to
1f1b's), with replicas, a tied weight across stages, LayerNorms, embeddings and dropout."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import Case, MpiRun, batched, write_plan
from tests.reference import reference_flush

GPT = {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256, "tie": True, "dropout": 0.1}
# (layer count, replicas) per stage, and m: replicas owning unequal shares, a replicated stage holding the tie.
SPLITS = {"2-stages-replicas-2-1": ([(2, 2), (2, 1)], 5), "3-stages-replicas-1-1-2": ([(1, 1), (2, 1), (1, 2)], 6)}
STEPS, B = 3, 2


def zero_bubble(d: Path, schedule: str, split: str) -> Case:
    stages, m = SPLITS[split]
    np_ = write_plan(d / "plan.json", schedule, m, stages)
    return Case(np_, ["--model", "gpt", "--model-args", json.dumps(GPT), "--plan", str(d / "plan.json"), "--steps",
                      str(STEPS), "--microbatch-size", str(B), "--dtype", "float64", "--device", "cpu", "--optimizer",
                      "sgd", "--lr", "0.05", "--momentum", "0.9", "--save", str(d / "model.pt"), "--trace",
                      str(d / "trace.json")],
                env={"PIPEFLOW_LOG": "INFO"})  # the engine says how many Linear modules split


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("schedule", ["zb", "zb-h2"])
@batched(zero_bubble)
def test_zero_bubble_equals_single_process(mpi: MpiRun, schedule, split):
    stages, m = SPLITS[split]
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("gpt", GPT, steps=STEPS, microbatches=m, microbatch_size=B, optimizer="sgd", lr=0.05,
                           momentum=0.9)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=k)
    initial = reference_flush("gpt", GPT, steps=0, microbatches=m, microbatch_size=B)
    assert all(not torch.equal(want[k], initial[k]) for k in ("1.qkv.weight", "0.tok.weight", "2.ln1.weight"))
    assert torch.equal(got["0.tok.weight"], got["3.lm.weight"])
    # Every rank split its Linear layers' backward: 4 per block, 1 in the head, none in the embedding.
    split = [int(n) for n in re.findall(rf"{schedule}: B defers the weight gradients of (\d+) nn.Linear",
                                         mpi.proc.stderr + mpi.proc.stdout)]
    per_stage, start = [], 0
    for count, reps in stages:
        per_stage += [sum(4 if 0 < i < 3 else i == 3 for i in range(start, start + count))] * reps
        start += count
    assert sorted(split) == sorted(per_stage)

    # The Chrome trace shows each W apart from its B: its own event, after the B, in the compute category.
    events = [e for e in json.loads((mpi.dir / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in range(len(per_stage)):
        mine = sorted((e for e in events if e["tid"] == rank and e["args"]["step"] == STEPS - 1), key=lambda e: e["ts"])
        b = {e["args"]["microbatch"]: e for e in mine if e["name"].startswith("B")}
        w = {e["args"]["microbatch"]: e for e in mine if e["name"].startswith("W")}
        assert set(w) == set(b) and b, rank
        assert all(w[i]["cat"] == "compute" and w[i]["ts"] >= b[i]["ts"] + b[i]["dur"] for i in w), rank


SMALL = {"d_in": 6, "hidden": 8, "classes": 3, "samples": 64}


def checkpointed(d: Path) -> Case:
    np_ = write_plan(d / "plan.json", "zb", 4, [(1, 1), (2, 2)])
    return Case(np_, ["--model", "tests.models_grads:twice", "--model-args", json.dumps(SMALL), "--plan",
                      str(d / "plan.json"), "--steps", str(STEPS), "--microbatch-size", str(B), "--dtype", "float64",
                      "--device", "cpu", "--optimizer", "sgd", "--lr", "0.05", "--save", str(d / "model.pt")])


@batched(checkpointed)
def test_zb_with_reentrant_checkpointing_on_replicas(mpi: MpiRun):
    """A Linear applied twice under reentrant checkpointing on a replicated stage: its B runs two nested
    backwards that record two weight GEMMs, its W sums them and accumulates once, and the replicas' all-reduce,
    armed for the last W, waits for it."""
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("tests.models_grads:twice", SMALL, steps=STEPS, microbatches=4, microbatch_size=B,
                           optimizer="sgd", lr=0.05)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=k)
