"""A run every rank stops at one step boundary (exit 4 on a non-finite step, a signal) writes its --trace: the trace
was written only at a normal finish, so a stopped run lost it, and the run resuming it appended to nothing."""
from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import Case, MpiRun, batched
from tests.test_failures import MLP


def stopped(d: Path) -> Case:
    return Case(2, ["--model", "tests.models:nan_mlp", "--model-args", json.dumps(MLP), "--no-shuffle",
                    "--layers-per-stage", "even", "--microbatches", "4", "--microbatch-size", "2", "--device", "cpu",
                    "--steps", "5", "--timeout", "60", "--trace", str(d / "trace.json"), "--tensorboard",
                    str(d / "tb")], check=False)


@batched(stopped)
def test_a_run_stopped_on_a_non_finite_step_writes_its_trace(mpi: MpiRun) -> None:
    assert mpi.proc.returncode == 4, mpi.proc.stderr
    events = json.loads((mpi.dir / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    # steps 0 and 1 trained, step 2 (the non-finite one) ran its actions and was not applied
    assert sorted({e["args"]["step"] for e in spans}) == [0, 1, 2]
    assert {e["tid"] for e in spans} == {0, 1}
