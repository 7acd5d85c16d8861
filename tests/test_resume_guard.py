"""A resumed run goes on as the uninterrupted run would: its lines name the run's step (an asynchronous stage's
update), and --max-skips counts the steps skipped before the checkpoint; the checkpoint records those counts (an
optional field: older markers read as 0). A step written again removes the temporary files a killed writer left."""
from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

from pipeflow import restore
from pipeflow.checkpoint import MARKER, CheckpointError
from pipeflow.failure import NonFiniteError
from pipeflow.guard import StepGuard
from pipeflow.signals import SignalStop
from tests.conftest import Case, MpiRun, batched
from tests.test_checkpoint import RUN, fake_engine, write_checkpoint

MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}


def nan_args(bad: list[int], *more: str) -> list[str]:
    """tests.models:nan_mlp with NaN inputs at `bad`: with --no-shuffle, sample 8k is step k+1's first."""
    return ["--model", "tests.models:nan_mlp", "--model-args", json.dumps({**MLP, "bad": bad}), "--no-shuffle",
            "--layers-per-stage", "even", "--microbatches", "4", "--microbatch-size", "2", "--device", "cpu",
            "--optimizer", "sgd", "--lr", "0.05", "--timeout", "60", *more]


# Temporary files a rank killed while writing step 4 would have left; (name, whether the checkpoint removes it)
LEFTOVERS = [(".stage-000.pt.tmp-999999", True), (".stage-001.pt.tmp-999998", True), (f".{MARKER}.tmp-999997", True),
             (".stage-007.pt.tmp-999999", False)]  # no stage 7: no writer of that file, which stays


def leave_temporaries(step_dir: str) -> None:
    """A case's `before`: step 4's directory as a kill -9 while writing it leaves it (no COMPLETE marker)."""
    d = Path(step_dir)
    d.mkdir(parents=True)
    for name, _ in LEFTOVERS:
        (d / name).write_bytes(b"\0" * 20000)


def runs(d: Path) -> list[Case]:
    """Steps 4, 5 and 6 non-finite under --max-skips 3: the whole run (exit 4 at step 6); 4 steps and a checkpoint
    (over a killed writer's leftovers), then resumed (exit 4 at step 6 again). async: 3 steps and a checkpoint, then
    resumed with --skip-nonfinite past sample 40 (microbatch 20: the 21st update of each stage)."""
    skips = nan_args([24, 32, 40], "--skip-nonfinite", "--max-skips", "3")
    ck, ck_async = d / "ck", d / "ck-async"
    return [Case(2, [*skips, "--steps", "8"], check=False),
            Case(2, [*skips, "--steps", "4", "--checkpoint-dir", str(ck)],
                 before=(f"{__name__}:leave_temporaries", [str(ck / "step-000004")])),
            Case(2, [*skips, "--steps", "8", "--checkpoint-dir", str(ck), "--resume"], check=False),
            Case(2, nan_args([40], "--schedule", "async", "--steps", "3", "--checkpoint-dir", str(ck_async))),
            Case(2, nan_args([40], "--schedule", "async", "--steps", "8", "--resume", str(ck_async),
                             "--skip-nonfinite"))]


def lines(err: str, start: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(start)]


STOP = ("pipeflow-train: non-finite loss on stage 1 (the last) and gradients on stages 0, 1 at step 6: 3 consecutive "
        "steps skipped (3 in all; --skip-nonfinite stops after --max-skips 3 in a row), the run is not recovering. "
        "Lower --lr or check the data")


def skipped_step(step: int) -> str:
    return (f"[rank 0] WARNING pipeflow.failure: non-finite loss on stage 1 (the last) and gradients on stages 0, 1 at "
            f"step {step}: step skipped (--skip-nonfinite)")


@batched(runs)
def test_a_resumed_run_stops_at_the_same_step_with_the_same_line(mpi: MpiRun) -> None:
    """--max-skips counts the skips before the checkpoint (step 4's), and the lines name the run's steps."""
    whole, first, resumed = mpi.procs[:3]
    assert whole.returncode == 4 and lines(whole.stderr, "pipeflow-train") == [STOP], whole.stderr
    assert lines(whole.stderr, "[rank 0] WARNING") == [skipped_step(4), skipped_step(5)], whole.stderr
    assert lines(first.stderr, "[rank 0] WARNING") == [skipped_step(4)], first.stderr
    assert resumed.returncode == 4 and lines(resumed.stderr, "pipeflow-train") == [STOP], resumed.stderr
    assert lines(resumed.stderr, "[rank 0] WARNING") == [skipped_step(5)], resumed.stderr
    marker = json.loads((mpi.dir / "ck" / "step-000004" / MARKER).read_text())
    assert [(st["skipped_in_a_row"], st["skipped_in_all"]) for st in marker["stages"]] == [(1, 1), (1, 1)]


@batched(runs)
def test_a_resumed_async_run_numbers_updates_from_the_runs_start(mpi: MpiRun) -> None:
    resumed = mpi.procs[4]
    assert lines(resumed.stderr, "[rank") == [
        "[rank 0] WARNING pipeflow.failure: non-finite gradients at update 21 on stage 0: skipped (--skip-nonfinite)",
        "[rank 1] WARNING pipeflow.failure: non-finite loss at update 21 on stage 1: skipped (--skip-nonfinite)",
    ], resumed.stderr


@batched(runs)
def test_a_checkpoint_removes_the_temporary_files_killed_writers_left(mpi: MpiRun) -> None:
    """Each file's writer removes its own file's leftovers (other ranks write other files meanwhile)."""
    d = mpi.dir / "ck" / "step-000004"
    assert {name for name, removed in LEFTOVERS if not removed} == {p.name for p in d.glob(".*")}
    assert restore.verify(d, restore.read_marker(d), range(2)) == []


# ------------------------------------------------------------------------------ in one process


def guard(*, flush: bool, max_skips: int = 0) -> StepGuard:
    """A StepGuard of a one-stage engine of 4 microbatches (one update per microbatch under async), weights w."""
    w = torch.nn.Parameter(torch.ones(3))
    engine = SimpleNamespace(S=1, s=0, actions=[], update=SimpleNamespace(checking=None), losses=[], m=4,
                             microbatches_per_step=4 if flush else 1, optimizer=torch.optim.SGD([w], lr=0.1),
                             parameters=lambda: [w], holds_last=False,
                             world=SimpleNamespace(device=torch.device("cpu")))
    w.grad = torch.full((3,), float("nan"))
    return StepGuard(engine, MPI.COMM_SELF, SignalStop(), skip_nonfinite=max_skips > 0, agree_every_step=flush,
                     max_skips=max_skips)


def test_a_resumed_flush_guard_names_the_runs_step_when_signalled() -> None:
    """The stop line's step and the checkpoint the supervisor saves there (step-000010) agree."""
    g = guard(flush=True)
    g.engine.parameters()[0].grad = torch.ones(3)
    g.resume(9)
    g.signals.signum = signal.SIGTERM
    assert g() is True
    assert g.stop_reason == "stopped by SIGTERM (received by rank 0) after step 10"


def test_a_resumed_async_guard_counts_updates_and_skips_from_the_checkpoint() -> None:
    g = guard(flush=False, max_skips=3)
    g.resume(5, in_a_row=2, in_all=4)  # 5 minibatches of 4 microbatches: 20 updates before
    with pytest.raises(NonFiniteError) as e:
        g()
    assert str(e.value) == ("non-finite gradients at update 21 on stage 0: 3 consecutive updates skipped (5 in all; "
                            "--skip-nonfinite stops after --max-skips 3 in a row), the run is not recovering. Lower "
                            "--lr or check the data")


def test_markers_without_the_skip_counts_read_as_none_skipped(tmp_path: Path) -> None:
    """Older checkpoints' markers have no skipped_in_a_row / skipped_in_all: they load, with 0; the counts of a
    stage holding the rank's layers are taken, the most where several do (another plan)."""
    d, _ = write_checkpoint(tmp_path, 3, [(0, 3), (3, 6)])
    marker = restore.read_marker(d)
    assert restore.skipped(fake_engine((0, 6)), marker) == (0, 0)
    for st, counts in zip(marker["stages"], [(1, 4), (2, 3)]):
        st["skipped_in_a_row"], st["skipped_in_all"] = counts
    (d / MARKER).write_text(json.dumps(marker))
    marker = restore.read_marker(d)
    assert restore.skipped(fake_engine((3, 6), 1), marker) == (2, 3)
    assert restore.skipped(fake_engine((2, 4)), marker) == (2, 4)
    marker["stages"][0]["skipped_in_a_row"] = -1
    (d / MARKER).write_text(json.dumps({**marker, "run": RUN}))
    with pytest.raises(CheckpointError, match=r"found stages\[0\]\.skipped_in_a_row -1 \(a int\)"):
        restore.read_marker(d)
