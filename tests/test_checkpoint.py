"""Checkpoints: per-layer storage, atomic files, COMPLETE markers, exact resume under mpirun (any plan)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeflow import checkpoint, restore
from pipeflow.checkpoint import CheckpointError
from pipeflow.hooks import WeightPolicy
from pipeflow.spec import build_model
from pipeflow.stage import Stage
from tests.conftest import Case, MpiRun, batched
from tests.reference import reference_flush

MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}
COMMON = ["--model", "mlp", "--model-args", json.dumps(MLP), "--layers-per-stage", "even", "--microbatch-size", "2",
          "--optimizer", "adam",
          "--lr", "0.01", "--dtype", "float64", "--device", "cpu", "--timeout", "60"]
RUN = {"model": "mlp", "model_args": MLP, "num_layers": 6, "seed": 0, "shuffle": True, "samples_per_step": 8}


# ------------------------------------------------------------------------------ in one process


def fake_engine(layers: tuple[int, int], s: int = 0, *, steps: int = 1) -> SimpleNamespace:
    """An object with the engine attributes checkpoint.py uses: layers [a, b) of the mlp, Adam after `steps`."""
    spec = build_model("mlp", MLP)
    stage = Stage(spec.layers[layers[0]:layers[1]], start=layers[0], first=s == 0, last=False, loss_fn=None,
                  device=torch.device("cpu"), dtype=torch.float64)
    opt = torch.optim.Adam(stage.parameters(), lr=0.01)
    for k in range(steps):
        for p in stage.parameters():
            p.grad = torch.full_like(p, 0.1 * (k + 1))
        opt.step()

    def state_dict() -> dict[str, torch.Tensor]:
        return {f"{int(k.partition('.')[0]) + layers[0]}.{k.partition('.')[2]}": v.detach().clone()
                for k, v in stage.module.state_dict().items()}

    return SimpleNamespace(stage=stage, optimizer=opt, policy=WeightPolicy(), world=SimpleNamespace(
        device=torch.device("cpu")), s=s, r=0, state_dict=state_dict)


def write_checkpoint(root: Path, step: int, splits: list[tuple[int, int]]) -> tuple[Path, list[SimpleNamespace]]:
    """What checkpoint.save writes, without MPI: one file per stage, then COMPLETE."""
    d = checkpoint.step_dir(root, step)
    d.mkdir(parents=True)
    engines = [fake_engine(r, s) for s, r in enumerate(splits)]
    for e in engines:
        payload = checkpoint.stage_payload(e, step, RUN)
        checkpoint.atomic_write(checkpoint.stage_file(d, e.s), lambda f, p=payload: torch.save(p, f))
    marker = {"format": checkpoint.CKPT_FORMAT, "step": step, "run": RUN,
              "stages": [{"file": checkpoint.stage_file(d, s).name, "layers": list(r)} for s, r in enumerate(splits)]}
    (d / checkpoint.MARKER).write_text(json.dumps(marker))
    return d, engines


def test_per_layer_state_loads_under_another_split(tmp_path):
    d, saved = write_checkpoint(tmp_path, 5, [(0, 2), (2, 4), (4, 6)])
    target = fake_engine((1, 5), 0, steps=0)  # straddles three saved stages, fresh optimizer
    assert restore.load(target, d, RUN) == 5
    want = {k: v for e in saved for k, v in e.state_dict().items()}
    for k, v in target.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0)
    by_name = {name: state for e in saved for name, state in checkpoint.optimizer_state(e)["state"].items()}
    got = checkpoint.optimizer_state(target)["state"]
    assert set(got) == {k for k in by_name if 1 <= int(k.split(".")[0]) < 5}
    for name, state in got.items():
        for key, value in state.items():
            torch.testing.assert_close(value, by_name[name][key], rtol=0, atol=0)


def test_latest_complete_and_errors(tmp_path):
    write_checkpoint(tmp_path, 3, [(0, 6)])
    write_checkpoint(tmp_path, 7, [(0, 6)])
    (tmp_path / "step-000009").mkdir()  # a run killed while writing step 9: no COMPLETE
    assert restore.resolve("latest", str(tmp_path)) == tmp_path / "step-000007"
    assert restore.resolve(str(tmp_path), None) == tmp_path / "step-000007"
    assert restore.resolve(str(tmp_path / "step-000003"), None) == tmp_path / "step-000003"
    assert restore.resolve("latest", str(tmp_path / "empty")) is None
    with pytest.raises(CheckpointError, match="incomplete"):
        restore.resolve(str(tmp_path / "step-000009"), None)
    with pytest.raises(CheckpointError, match="no such file"):
        restore.resolve(str(tmp_path / "nope"), None)
    with pytest.raises(CheckpointError, match="needs --checkpoint-dir"):
        restore.resolve("latest", None)
    with pytest.raises(CheckpointError, match="samples_per_step 8 -> 16"):
        restore.load(fake_engine((0, 6), steps=0), tmp_path / "step-000007", {**RUN, "samples_per_step": 16})
    with pytest.raises(CheckpointError, match="model of 6 layers"):
        restore.load(fake_engine((0, 6), steps=0), tmp_path / "step-000007", {**RUN, "num_layers": 8})


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "f.pt"
    checkpoint.atomic_write(path, lambda f: f.write(b"old"))

    def boom(f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        checkpoint.atomic_write(path, boom)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.pt"]


@pytest.fixture(scope="module")
def stage_bytes(tmp_path_factory) -> bytes:
    d, _ = write_checkpoint(tmp_path_factory.mktemp("ck"), 1, [(0, 6)])
    return checkpoint.stage_file(d, 0).read_bytes()


@settings(max_examples=40, deadline=None)
@given(cut=st.floats(0, 0.999))
def test_truncated_file_is_a_clear_error(tmp_path_factory, stage_bytes, cut):
    path = tmp_path_factory.mktemp("t") / "stage-000.pt"
    path.write_bytes(stage_bytes[:int(len(stage_bytes) * cut)])
    with pytest.raises(CheckpointError, match=r"stage-000\.pt.*expected"):
        restore.load_stage_file(path)


@pytest.mark.parametrize("obj", [{"weights": {}}, {"format": "pipeflow.checkpoint/1", "step": "5"}, [1, 2],
                                 {"format": "pipeflow.checkpoint/1", "step": 1, "stage": 0, "layers": [0, 6],
                                  "weights": {"0.w": 3}, "optimizer": {}, "rng": {}, "run": {}}])
def test_foreign_file_is_a_clear_error(tmp_path, obj):
    path = tmp_path / "stage-000.pt"
    torch.save(obj, path)
    with pytest.raises(CheckpointError, match=r"stage-000\.pt: (foreign|malformed).*expected"):
        restore.load_stage_file(path)


def test_file_needing_unsafe_pickle_is_refused(tmp_path):
    path = tmp_path / "stage-000.pt"
    torch.save({"format": checkpoint.CKPT_FORMAT, "obj": SimpleNamespace(a=1)}, path)
    with pytest.raises(CheckpointError, match="cannot load it"):
        restore.load_stage_file(path)


# ------------------------------------------------------------------------------ under mpirun


def uninterrupted(d: Path) -> Case:
    return Case(2, [*COMMON, "--microbatches", "4", "--steps", "10", "--save", str(d / "uninterrupted.pt")])


def stopped_at_7(d: Path) -> Case:
    return Case(2, [*COMMON, "--microbatches", "4", "--steps", "7", "--checkpoint-dir", str(d / "ck"),
                    "--checkpoint-every", "5"])


def resume_same_plan(d: Path) -> list[Case]:
    return [uninterrupted(d), stopped_at_7(d),
            Case(2, [*COMMON, "--microbatches", "4", "--steps", "10", "--resume", str(d / "ck" / "step-000005"),
                     "--save", str(d / "resumed.pt")])]


@batched(resume_same_plan)
def test_resume_is_exact(mpi: MpiRun):
    stopped = mpi.dir / "ck"
    assert sorted(p.name for p in stopped.iterdir()) == ["pipeflow.lock", "step-000005", "step-000007"]
    assert sorted(p.name for p in (stopped / "step-000005").iterdir()) == [
        "COMPLETE", "stage-000.pt", "stage-001.pt"]
    got = torch.load(mpi.dir / "resumed.pt", weights_only=True)
    whole = torch.load(mpi.dir / "uninterrupted.pt", weights_only=True)
    assert list(got) == list(whole)
    for k in got:
        assert torch.equal(got[k], whole[k]), k


def resume_other_plan(d: Path) -> list[Case]:
    # 3 workers, stage 1 replicated, other split; 2 microbatches of 4 = the same 8 samples per step.
    plan = {"format": "pipeflow.plan/1", "schedule": "gpipe", "microbatches": 2, "workers": 3,
            "stages": [{"layers": [0, 2], "replicas": 1, "ranks": [0]},
                       {"layers": [2, 6], "replicas": 2, "ranks": [1, 2]}]}
    (d / "plan.json").write_text(json.dumps(plan))
    split = COMMON.index("--layers-per-stage")  # the plan gives the split
    args = [*COMMON[:split], *COMMON[split + 2:], "--plan", str(d / "plan.json"), "--microbatch-size", "4",
            "--steps", "10", "--resume", str(d / "ck" / "step-000005"), "--save", str(d / "resumed.pt")]
    return [uninterrupted(d), stopped_at_7(d), Case(3, args)]


@batched(resume_other_plan)
def test_resume_under_other_plan_and_workers(mpi: MpiRun):
    tmp_path = mpi.dir
    uninterrupted = torch.load(tmp_path / "uninterrupted.pt", weights_only=True)
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    want = reference_flush("mlp", MLP, steps=10, microbatches=4, microbatch_size=2, optimizer="adam", lr=0.01)
    for k in want:
        torch.testing.assert_close(uninterrupted[k], want[k], rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)
