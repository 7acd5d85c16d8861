"""Checkpoints of ranks holding several chunks (--schedule interleaved): one file per model stage, the
optimizer state split per chunk, exact resume, and resume across interleaved and 1f1b plans (per layer)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeflow import checkpoint, restore
from pipeflow.checkpoint import CheckpointError
from pipeflow.hooks import WeightPolicy
from pipeflow.spec import build_model
from pipeflow.stage import Stage
from tests.conftest import Case, MpiRun, batched
from tests.reference import reference_flush

MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}
COMMON = ["--model", "mlp", "--model-args", json.dumps(MLP), "--layers-per-stage", "even", "--microbatch-size", "2",
          "--microbatches", "4", "--optimizer", "adam", "--lr", "0.01", "--dtype", "float64", "--device", "cpu",
          "--timeout", "60"]
INTERLEAVED = [*COMMON, "--schedule", "interleaved", "--virtual-stages", "2"]
FLAT = [*COMMON, "--schedule", "1f1b"]
RUN = {"model": "mlp", "model_args": MLP, "num_layers": 6, "seed": 0, "shuffle": True, "samples_per_step": 8}


def _want() -> dict[str, torch.Tensor]:
    return reference_flush("mlp", MLP, steps=10, microbatches=4, microbatch_size=2, optimizer="adam", lr=0.01)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)


# ------------------------------------------------------------------------------ in one process


def fake_engine(chunks: dict[int, tuple[int, int]], *, steps: int) -> SimpleNamespace:
    """The engine attributes checkpoint.py reads, for a rank holding `chunks` (model stage -> layers) of the
    mlp under one Adam optimizer, after `steps` updates with gradients that differ per parameter."""
    spec = build_model("mlp", MLP)
    stages = {k: Stage(spec.layers[a:b], start=a, first=a == 0, last=b == 6, loss_fn=None,
                       device=torch.device("cpu"), dtype=torch.float64) for k, (a, b) in chunks.items()}
    params = [p for c in stages.values() for p in c.parameters()]
    opt = torch.optim.Adam(params, lr=0.01)
    for n in range(steps):
        for j, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (n + 1) + 0.01 * j)
        opt.step()
    first = min(stages)
    return SimpleNamespace(stages=stages, stage=stages[first], optimizer=opt, policy=WeightPolicy(),
                           world=SimpleNamespace(device=torch.device("cpu")), s=first, r=0,
                           state_dict=lambda: {k: v for c in stages.values() for k, v in c.model_state_dict().items()})


def write(root: Path, engines: list[SimpleNamespace], layers: list[tuple[int, int]]) -> Path:
    """What checkpoint.save writes, without MPI: each engine's file per chunk, then COMPLETE."""
    d = checkpoint.step_dir(root, 3)
    d.mkdir(parents=True)
    for e in engines:
        for k in e.stages:
            payload = checkpoint.stage_payload(e, 3, RUN, k)
            checkpoint.atomic_write(checkpoint.stage_file(d, k), lambda f, p=payload: torch.save(p, f))
    marker = {"format": checkpoint.CKPT_FORMAT, "step": 3, "run": RUN,
              "stages": [{"file": checkpoint.stage_file(d, k).name, "layers": list(r)} for k, r in enumerate(layers)]}
    (d / checkpoint.MARKER).write_text(json.dumps(marker))
    return d


def _optimizer_by_name(engines: list[SimpleNamespace]) -> dict[str, dict[str, torch.Tensor]]:
    return {n: s for e in engines for n, s in checkpoint.optimizer_state(e)["state"].items()}


def test_chunk_files_round_trip_between_interleaved_and_flat_splits(tmp_path):
    layers = [(0, 2), (2, 3), (3, 5), (5, 6)]
    ranks = [fake_engine({0: layers[0], 2: layers[2]}, steps=2), fake_engine({1: layers[1], 3: layers[3]}, steps=2)]
    d = write(tmp_path / "inter", ranks, layers)
    files = {k: restore.load_stage_file(checkpoint.stage_file(d, k)) for k in range(4)}
    # Each chunk's file holds its own layers' weights and optimizer state, nothing of the rank's other chunk.
    for k, (a, b) in enumerate(layers):
        assert files[k]["stage"] == k and files[k]["layers"] == [a, b]
        assert {int(n.split(".")[0]) for n in files[k]["weights"]} == set(range(a, b))
        assert {int(n.split(".")[0]) for n in files[k]["optimizer"]["state"]} == set(range(a, b))
    weights = {k: v for e in ranks for k, v in e.state_dict().items()}
    states = _optimizer_by_name(ranks)
    # Under a flat split of 2 stages, and back under the interleaved one from the flat files.
    flat = [fake_engine({0: (0, 3)}, steps=0), fake_engine({1: (3, 6)}, steps=0)]
    for e in flat:
        assert restore.load(e, d, RUN) == 3
    again = [fake_engine({0: layers[0], 2: layers[2]}, steps=0), fake_engine({1: layers[1], 3: layers[3]}, steps=0)]
    d2 = write(tmp_path / "flat", flat, [(0, 3), (3, 6)])
    for e in again:
        assert restore.load(e, d2, RUN) == 3
    for engines in (flat, again):
        got = {k: v for e in engines for k, v in e.state_dict().items()}
        assert set(got) == set(weights)
        for k in weights:
            torch.testing.assert_close(got[k], weights[k], rtol=0, atol=0)
        got_states = _optimizer_by_name(engines)
        assert set(got_states) == set(states)
        for name, state in states.items():
            for key, value in state.items():
                torch.testing.assert_close(got_states[name][key], value, rtol=0, atol=0)


def test_layers_missing_for_one_chunk_are_named_with_every_chunk(tmp_path):
    layers = [(0, 2), (2, 4), (4, 5), (5, 6)]
    ranks = [fake_engine({0: layers[0], 2: layers[2]}, steps=1), fake_engine({1: layers[1], 3: layers[3]}, steps=1)]
    d = write(tmp_path, ranks, layers)
    marker = json.loads((d / checkpoint.MARKER).read_text())
    marker["stages"] = marker["stages"][:2]  # a marker that lost the stages of layers [4, 6)
    with pytest.raises(CheckpointError) as e:
        restore.load(fake_engine({0: layers[0], 2: layers[2]}, steps=0), d, RUN, marker)
    assert str(e.value) == (f"{d} (stage-000.pt): parameters do not match layers [0, 2), [4, 5) of this model: "
                            "missing ['4.fc.weight', '4.fc.bias'], unexpected []")


# ------------------------------------------------------------------------------ under mpirun


def interleaved_stopped_and_resumed(d: Path) -> list[Case]:
    ck, flat_ck = d / "ck", d / "flat_ck"
    return [
        Case(2, [*INTERLEAVED, "--steps", "10", "--save", str(d / "uninterrupted.pt")]),
        Case(2, [*INTERLEAVED, "--steps", "7", "--checkpoint-dir", str(ck), "--checkpoint-every", "5"]),
        Case(2, [*INTERLEAVED, "--steps", "10", "--resume", str(ck / "step-000005"), "--save", str(d / "resumed.pt")]),
        # The interleaved checkpoint under a 1f1b plan (a stage straddles chunk files of both ranks) ...
        Case(2, [*FLAT, "--steps", "10", "--resume", str(ck / "step-000005"), "--save", str(d / "as_1f1b.pt")]),
        # ... and a 1f1b checkpoint under the interleaved plan.
        Case(2, [*FLAT, "--steps", "7", "--checkpoint-dir", str(flat_ck), "--checkpoint-every", "5"]),
        Case(2, [*INTERLEAVED, "--steps", "10", "--resume", str(flat_ck / "step-000005"),
                 "--save", str(d / "from_1f1b.pt")]),
    ]


@batched(interleaved_stopped_and_resumed)
def test_interleaved_resume_is_exact(mpi: MpiRun):
    step5 = mpi.dir / "ck" / "step-000005"
    assert sorted(p.name for p in step5.iterdir()) == [
        "COMPLETE", "stage-000.pt", "stage-001.pt", "stage-002.pt", "stage-003.pt"]
    marker = json.loads((step5 / "COMPLETE").read_text())
    assert marker["format"] == "pipeflow.checkpoint/1" and marker["run"]["virtual_stages"] == 2
    assert [s["layers"] for s in marker["stages"]] == [[0, 2], [2, 4], [4, 5], [5, 6]]
    got = torch.load(mpi.dir / "resumed.pt", weights_only=True)
    whole = torch.load(mpi.dir / "uninterrupted.pt", weights_only=True)
    assert list(got) == list(whole)
    for k in got:
        assert torch.equal(got[k], whole[k]), k
    _close(whole, _want())


@batched(interleaved_stopped_and_resumed)
def test_interleaved_checkpoint_resumes_under_1f1b_and_back(mpi: MpiRun):
    want = _want()
    _close(torch.load(mpi.dir / "as_1f1b.pt", weights_only=True), want)
    _close(torch.load(mpi.dir / "from_1f1b.pt", weights_only=True), want)
