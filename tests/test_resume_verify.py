"""Resuming: a corrupt newest checkpoint falls back to the newest one that verifies (sizes and sha256 in the
COMPLETE marker), --steps not beyond the checkpoint says so, and a resumed run appends to --trace and TensorBoard."""
from __future__ import annotations

import json
import logging
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from pipeflow.checkpoint import MARKER, CheckpointError
from pipeflow.resume import choose
from tests.conftest import Case, MpiRun, batched
from tests.reference import reference_flush

MLP = {"layers": 4, "hidden": 16, "d_in": 8, "samples": 256}
COMMON = ["--model", "mlp", "--model-args", json.dumps(MLP), "--layers-per-stage", "even", "--microbatches", "2",
          "--microbatch-size", "2", "--optimizer", "adam", "--lr", "0.01", "--dtype", "float64", "--device", "cpu",
          "--timeout", "60", "--checkpoint-every", "2", "--log-every", "1"]


def copy_run(first: str, to: str, damaged: str | None = None) -> None:
    """A copy of the first run to resume (a case's `before`), with `damaged` (a stage file) bit-flipped."""
    shutil.copytree(first, to)
    if damaged:
        damage(Path(to) / damaged, "bitflip")


def runs(d: Path) -> list[Case]:
    """The module's one batched run: 4 steps with checkpoints at 2 and 4, a trace and TensorBoard scalars
    (first/); resumed past a bit flip in a copy (flipped/); resumed with --steps 4 in another (again/)."""
    first, flipped, again = d / "first", d / "flipped", d / "again"
    first.mkdir()
    return [Case(2, [*COMMON, "--steps", "4", "--checkpoint-dir", str(first / "ck"), "--trace",
                     str(first / "trace.json"), "--tensorboard", str(first / "tb")]),
            Case(2, [*COMMON, "--steps", "6", "--checkpoint-dir", str(flipped / "ck"), "--resume", "--trace",
                     str(flipped / "trace.json"), "--tensorboard", str(flipped / "tb"), "--save",
                     str(flipped / "resumed.pt")],
                 before=(f"{__name__}:copy_run", [str(first), str(flipped), "ck/step-000004/stage-000.pt"])),
            Case(2, [*COMMON, "--steps", "4", "--checkpoint-dir", str(again / "ck"), "--resume",
                     "--save", str(again / "model.pt")],
                 before=(f"{__name__}:copy_run", [str(first), str(again)]))]


@pytest.fixture
def run_dir(mpi: MpiRun, tmp_path) -> Path:
    """A copy of the first run to damage and resume (the tests that use it are @batched(runs))."""
    d = tmp_path / "run"
    shutil.copytree(mpi.dir / "first", d)
    return d


def flip_a_weight_byte(path: Path) -> None:
    """Flip one bit inside a tensor's bytes: the zip stays readable, so only a checksum can tell."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def damage(path: Path, how: str) -> str:
    """Damage a stage file; returns what the resume says about it."""
    if how == "truncated":
        size = path.stat().st_size
        path.write_bytes(path.read_bytes()[: size // 2])
        return f"is truncated or overwritten ({size // 2} bytes, {MARKER} says {size})"
    if how == "missing":
        path.unlink()
        return "is missing"
    flip_a_weight_byte(path)
    return f"is corrupt (its sha256 differs from the one in {MARKER})"


# ------------------------------------------------------------------------------ choosing, in one process


@pytest.mark.parametrize("how", ["truncated", "missing", "bitflip"])
@batched(runs)
def test_corrupt_newest_checkpoint_falls_back_naming_the_file(run_dir, how, caplog):
    from mpi4py import MPI

    ck = run_dir / "ck"
    bad = ck / "step-000004" / "stage-001.pt"
    what = damage(bad, how)
    with caplog.at_level(logging.WARNING, logger="pipeflow.resume"):
        path, marker = choose(MPI.COMM_SELF, "latest", str(ck))
    assert path == ck / "step-000002" and marker is not None and marker["step"] == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"--resume: {bad} {what}; resuming from {ck / 'step-000002'} instead, the newest checkpoint that verifies"]


@batched(runs)
def test_named_corrupt_step_and_nothing_that_verifies_are_errors(run_dir):
    from mpi4py import MPI

    ck = run_dir / "ck"
    damage(ck / "step-000004" / "stage-000.pt", "bitflip")
    with pytest.raises(CheckpointError, match=rf"^--resume {ck}/step-000004: {ck}/step-000004/stage-000\.pt is "
                                              r"corrupt \(its sha256 differs from the one in COMPLETE\); resume from "
                                              "an earlier step"):
        choose(MPI.COMM_SELF, str(ck / "step-000004"), None)
    damage(ck / "step-000002" / "stage-001.pt", "missing")
    with pytest.raises(CheckpointError, match=rf"^--resume: no checkpoint in {ck} verifies: .*step-000004/stage-000"
                                              r"\.pt is corrupt .*; .*step-000002/stage-001\.pt is missing$"):
        choose(MPI.COMM_SELF, "latest", str(ck))


@batched(runs)
def test_marker_without_checksums_still_resumes(run_dir):
    """Checkpoints written before the marker held sizes and checksums."""
    from mpi4py import MPI

    marker_path = run_dir / "ck" / "step-000004" / MARKER
    marker = json.loads(marker_path.read_text())
    assert all(isinstance(s["bytes"], int) and len(s["sha256"]) == 64 for s in marker["stages"])
    for s in marker["stages"]:
        del s["bytes"], s["sha256"]
    marker_path.write_text(json.dumps(marker))
    path, got = choose(MPI.COMM_SELF, "latest", str(run_dir / "ck"))
    assert path == run_dir / "ck" / "step-000004" and got == marker


# ------------------------------------------------------------------------------ under mpirun


def _scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@batched(runs)
def test_resume_past_a_bit_flip_is_exact_and_appends_trace_and_tensorboard(mpi: MpiRun):
    first_loss = _scalars(mpi.dir / "first" / "tb", "loss/train")
    assert [s for s, _ in first_loss] == [1, 2, 3, 4]
    run_dir = mpi.dir / "flipped"
    bad = run_dir / "ck" / "step-000004" / "stage-000.pt"
    out = run_dir / "resumed.pt"
    proc = mpi.procs[1]
    assert (f"--resume: {bad} is corrupt (its sha256 differs from the one in COMPLETE); resuming from "
            f"{run_dir / 'ck' / 'step-000002'} instead, the newest checkpoint that verifies") in proc.stderr
    got = torch.load(out, weights_only=True)
    want = reference_flush("mlp", MLP, steps=6, microbatches=2, microbatch_size=2, optimizer="adam", lr=0.01)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)
    # The trace: the first run's steps before the checkpoint (0, 1), then this run's (2..5) after them.
    spans = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    steps = {pid: sorted({e["args"]["step"] for e in spans if e["pid"] == pid}) for pid in {e["pid"] for e in spans}}
    assert steps == {0: [0, 1], 1: [2, 3, 4, 5]}
    assert max(e["ts"] + e["dur"] for e in spans if e["pid"] == 0) < min(e["ts"] for e in spans if e["pid"] == 1)
    # TensorBoard: steps 1-2 as the first run logged them, 3-6 from this run (the first run's 3-4 purged).
    loss = _scalars(run_dir / "tb", "loss/train")
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    assert loss[:2] == first_loss[:2]


@batched(runs)
def test_resume_with_steps_not_beyond_the_checkpoint_says_so(mpi: MpiRun):
    run_dir = mpi.dir / "again"
    out = run_dir / "model.pt"
    proc = mpi.procs[2]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pipeflow-train:")]
    assert lines == [f"pipeflow-train: nothing to train: the checkpoint {run_dir / 'ck' / 'step-000004'} is at step 4 "
                     f"and --steps is 4; pass --steps above 4 to train on (--save {out} not written)"], proc.stderr
    assert not out.exists()
