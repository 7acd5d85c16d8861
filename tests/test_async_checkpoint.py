"""async / 2bw with --checkpoint-dir: segments that drain the pipeline (stash.py, "Segments"), exact
resume from a segment boundary, SIGTERM stops at a boundary with a checkpoint."""
from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import Case, MpiRun, batched, in_background, write_plan
from tests.reference import reference_delayed
from tests.test_failures import LONG, finish, start

MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}
B = 2


def train_args(plan, steps: int, every: int, ck, optimizer: str = "sgd") -> list[str]:
    lr = "0.05" if optimizer == "sgd" else "0.01"
    return ["--model", "mlp", "--model-args", json.dumps(MLP), "--plan", str(plan), "--steps", str(steps),
            "--microbatch-size", str(B), "--optimizer", optimizer, "--lr", lr,
            "--momentum", "0.9" if optimizer == "sgd" else "0", "--dtype", "float64", "--device", "cpu",
            "--timeout", "60", "--checkpoint-dir", str(ck), "--checkpoint-every", str(every)]


# (schedule, stages [(layers, replicas)], m): 5 steps in segments of 2, 2, 1 minibatches.
CASES = {
    "async-np2": ("async", [(3, 1), (3, 1)], 3),
    "2bw-np2": ("2bw", [(3, 1), (3, 1)], 3),
    "async-np3-replicated": ("async", [(2, 2), (4, 1)], 2),
}


def segmented(d: Path, case: str) -> Case:
    schedule, stages, m = CASES[case]
    plan = d / "plan.json"
    np_ = write_plan(plan, schedule, m, stages)
    return Case(np_, [*train_args(plan, 5, 2, d / "ck"), "--save", str(d / "model.pt")])


@pytest.mark.parametrize("case", list(CASES))
@batched(segmented)
def test_segmented_run_equals_segmented_reference(mpi: MpiRun, case):
    tmp_path = mpi.dir
    schedule, stages, m = CASES[case]
    steps, every = 5, 2
    got = torch.load(tmp_path / "model.pt", weights_only=True)
    kw = dict(schedule=schedule, stages=stages, steps=steps, microbatches=m, microbatch_size=B, optimizer="sgd",
              lr=0.05, momentum=0.9)
    want = reference_delayed("mlp", MLP, segment=every * m, **kw)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=f"{case}: {k}")
    # Draining matters: the unsegmented rule gives other weights.
    whole = reference_delayed("mlp", MLP, **kw)
    assert any(not torch.allclose(want[k], whole[k], rtol=1e-6, atol=1e-8) for k in want)
    # A checkpoint at each boundary (2, 4) and at the end (5); the last equals the saved model.
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-000002", "step-000004", "step-000005"]
    assert all((tmp_path / "ck" / d / "COMPLETE").is_file() for d in ("step-000002", "step-000004", "step-000005"))


def resumed_and_whole(d: Path, schedule: str) -> list[Case]:
    """4 steps with checkpoints, then 6 resumed from them, and 6 uninterrupted (the resume adds only
    step-000006 to ck/: step-000004 is the first run's)."""
    plan = d / "plan.json"
    np_ = write_plan(plan, schedule, 3, [(3, 1), (3, 1)])
    ck = d / "ck"
    return [Case(np_, train_args(plan, 4, 2, ck, "adam")),
            Case(np_, [*train_args(plan, 6, 2, ck, "adam"), "--resume", "--save", str(d / "resumed.pt")],
                 env={"PIPEFLOW_LOG": "INFO"}),
            Case(np_, [*train_args(plan, 6, 2, d / "ck2", "adam"), "--save", str(d / "whole.pt")])]


@pytest.mark.parametrize("schedule", ["async", "2bw"])
@batched(resumed_and_whole)
def test_resume_equals_uninterrupted_run(mpi: MpiRun, schedule):
    tmp_path = mpi.dir
    ck = tmp_path / "ck"
    assert (ck / "step-000004" / "COMPLETE").is_file()
    resumed, whole = tmp_path / "resumed.pt", tmp_path / "whole.pt"
    proc = mpi.procs[1]
    assert "continuing after step 4" in proc.stderr and "Traceback" not in proc.stderr
    a, b = torch.load(resumed, weights_only=True), torch.load(whole, weights_only=True)
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (ck / "step-000006" / "COMPLETE").is_file()


@in_background
def test_sigterm_stops_async_at_a_segment_boundary(tmp_path):
    ck = tmp_path / "ck"
    args = [*LONG, "--schedule", "async", "--timeout", "30", "--checkpoint-dir", str(ck), "--checkpoint-every", "1"]
    proc, pids = start(tmp_path, 2, args)
    os.kill(pids[1], signal.SIGTERM)
    rc, out, _ = finish(proc, pids, 60)
    assert rc == 128 + signal.SIGTERM, out
    msgs = [line for line in out.splitlines() if line.startswith("pipeflow-train:")]
    assert len(msgs) == 1 and "stopped by SIGTERM (received by rank 1)" in msgs[0], out
    step = int(re.search(r"after step (\d+)", msgs[0]).group(1))
    assert f"step-{step:06d}" in msgs[0] and "resume with --resume" in msgs[0]
    assert (ck / f"step-{step:06d}" / "COMPLETE").is_file()
    assert "Traceback" not in out
