"""Bad input to pipeflow-train found by a sweep: output paths that clash or are empty, a new run over an earlier
run's checkpoints, ranks started with different arguments, empty datasets and bad built-in model arguments,
planning flags that would be ignored or checked only after profiling, --global-batch with --microbatch-size,
--seed and --log-every out of range, a checkpoint marker of another format. Each is one line and exit 2 at set-up
(docs/failures.md); most are checked in this process, the wiring under mpirun in two batches."""
from __future__ import annotations

import inspect
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from pipeflow import config
from pipeflow.checkpoint import CKPT_FORMAT, CheckpointError
from pipeflow.failure import UsageError
from pipeflow.models import mlp
from pipeflow.outputs import OutputError, prepare_outputs, release_checkpoint_lock
from pipeflow.preflight import different_arguments
from pipeflow.spec import ModelError, ModelSpec, build_model
from pipeflow.train import build_parser, check_args
from tests.conftest import Case, MpiRun, batched, write_plan

MLP = {"layers": 4, "hidden": 8, "d_in": 4, "samples": 64}
BASE = ["--model", "mlp", "--model-args", json.dumps(MLP), "--device", "cpu"]


def flags(*argv: str) -> config.TrainConfig:
    return check_args(build_parser().parse_args([*BASE, *argv]))


# ------------------------------------------------------------------------------ output and input paths


def clash(flag: str, path: str, other: str, input: bool = False) -> str:
    """The line for output `flag` at `path`, also the path of output or input `other`."""
    why = (f"an input of this run, which writing {flag} would overwrite; give {flag} another path" if input
           else "so one output would overwrite the other; give each output its own path")
    return f"{flag} {path}: is also {other}'s path, {why}"


def among_checkpoints(flag: str, path: str) -> str:
    return (f"{flag} {path}: is where --checkpoint-dir {{t}}/ck writes its checkpoints (step-NNNNNN/, pipeflow.lock), "
            f"which would overwrite it; give {flag} another path")


@pytest.mark.parametrize(("argv", "message"), [
    (["--save", "{t}/same.out", "--trace", "{t}/same.out"], clash("--trace", "{t}/same.out", "--save")),
    (["--save", "{t}/m.pt", "--trace", "{t}/sub/../m.pt"], clash("--trace", "{t}/sub/../m.pt", "--save")),
    (["--tensorboard", "{t}/out", "--checkpoint-dir", "{t}/out"], clash("--checkpoint-dir", "{t}/out",
                                                                        "--tensorboard")),
    (["--plan", "{t}/plan.json", "--save", "{t}/plan.json"], clash("--save", "{t}/plan.json", "--plan", True)),
    (["--plan", "{t}/plan.json", "--trace", "{t}/link.json"], clash("--trace", "{t}/link.json", "--plan", True)),
    (["--resume", "{t}/ck/step-000001", "--tensorboard", "{t}/ck/step-000001"],
     clash("--tensorboard", "{t}/ck/step-000001", "--resume", True)),
    (["--checkpoint-dir", "{t}/ck", "--resume", "--save", "{t}/ck/pipeflow.lock"],
     among_checkpoints("--save", "{t}/ck/pipeflow.lock")),
    (["--checkpoint-dir", "{t}/ck", "--resume", "--trace", "{t}/ck/step-000001/trace.json"],
     among_checkpoints("--trace", "{t}/ck/step-000001/trace.json")),
    (["--save", ""], "--save must be a file path, found ''"),
    (["--trace", ""], "--trace must be a file path, found ''"),
    (["--tensorboard", ""], "--tensorboard must be a directory path, found ''"),
    (["--checkpoint-dir", ""], "--checkpoint-dir must be a directory path, found ''"),
    (["--plan", ""], "--plan must be a plan.json path, found ''"),
    (["--checkpoint-dir", "{t}/ck", "--resume", ""],
     "--resume must be a checkpoint path (no value: the newest in --checkpoint-dir), found ''"),
])
def test_outputs_that_clash_or_are_empty_are_refused(tmp_path: Path, argv: list[str], message: str) -> None:
    """Before, the trace was lost (written over by --save, or the other way round), the plan overwritten, and an
    empty path meant 'not given': exit 0 with nothing saved."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "ck" / "step-000001").mkdir(parents=True)
    write_plan(tmp_path / "plan.json", "1f1b", 4, [(2, 1), (2, 1)])
    (tmp_path / "link.json").symlink_to(tmp_path / "plan.json")
    with pytest.raises(OutputError) as e:
        prepare_outputs(flags(*(a.format(t=tmp_path) for a in argv)), 1)
    assert str(e.value) == message.format(t=tmp_path)


def test_outputs_beside_each_other_and_a_resumed_checkpoint_dir_pass(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    Path(ck).mkdir()
    prepare_outputs(flags("--checkpoint-dir", ck, "--resume", ck, "--save", f"{ck}/model.pt", "--trace",
                          f"{ck}/trace.json", "--tensorboard", f"{ck}/tb"), 1)


def test_a_new_run_in_a_checkpoint_dir_holding_checkpoints_is_refused(tmp_path: Path) -> None:
    """Before, its step directories replaced the earlier run's one by one, and a later --resume read a mix of the two
    models. --resume continues it; a directory without a complete checkpoint takes a new run, or --resume (from step
    0, with a warning)."""
    ck, fresh = tmp_path / "ck", tmp_path / "fresh"
    for step, complete in ((2, True), (3, True), (4, False)):  # step 4: a run stopped while writing it
        (ck / f"step-{step:06d}").mkdir(parents=True)
        if complete:
            (ck / f"step-{step:06d}" / "COMPLETE").write_text("{}")
    (fresh / "step-000001").mkdir(parents=True)
    try:
        with pytest.raises(OutputError) as e:
            prepare_outputs(flags("--checkpoint-dir", str(ck)), 0)
        assert str(e.value) == (f"--checkpoint-dir {ck} holds the checkpoints of an earlier run (the newest complete "
                                f"one: {ck}/step-000003), which this run would overwrite; pass --resume to continue "
                                "it, or choose another --checkpoint-dir")
        prepare_outputs(flags("--checkpoint-dir", str(ck), "--resume"), 0)
        for argv in ([], ["--resume"]):
            prepare_outputs(flags("--checkpoint-dir", str(fresh), *argv), 0)
            prepare_outputs(flags("--checkpoint-dir", str(tmp_path / "new"), *argv), 0)
    finally:
        release_checkpoint_lock()


# ------------------------------------------------------------------------------ ranks started differently


def test_different_arguments_name_the_first_flag_and_the_ranks() -> None:
    same = {"model": "mlp", "steps": 2, "plan": None, "straight": False, "lr": float("nan")}
    assert different_arguments([same, dict(same), dict(same)]) is None  # a nan is the same nan
    start = "the ranks were started with different arguments: "
    end = "; start every rank with the same pipeflow-train arguments"
    for other, says in [({"steps": 3, "plan": "p.json"}, "--steps is 2 on rank 0 and 3 on rank 2"),
                        ({"plan": "p.json"}, "--plan is not given on rank 0 and p.json on rank 2"),
                        ({"straight": True}, "--straight is not given on rank 0 and given on rank 2"),
                        ({"model": ""}, "--model is mlp on rank 0 and '' on rank 2")]:
        assert different_arguments([same, dict(same), {**same, **other}]) == start + says + end


def mpmd_ranks(d: Path) -> list[Case]:
    """mpirun -np 1 pipeflow-train ... --steps 2 : -np 1 pipeflow-train ... --steps 3 (tests/mpmd_ranks.py)."""
    common = [*BASE, "--layers-per-stage", "even", "--timeout", "10"]
    return [Case(2, [json.dumps(own), *common], main="tests.mpmd_ranks:main", check=False, timeout=60)
            for own in ([["--steps", "2"], ["--steps", "3"]],
                        [["--steps", "1", "--microbatch-size", "4"], ["--steps", "1", "--microbatch-size", "2"]])]


@batched(mpmd_ranks)
def test_ranks_started_with_different_arguments_stop_at_set_up(mpi: MpiRun) -> None:
    """Before, rank 1 of the first run waited forever for a step rank 0 never ran (past --timeout: both ranks were
    alive and beating, and the stages' gloo groups waited torch's 30 minutes), and the second ended in a traceback
    of torch's. Now one line, exit 2, on every rank, before any process group."""
    for proc, says in zip(mpi.procs, ("--steps is 2 on rank 0 and 3 on rank 1",
                                      "--microbatch-size is 4 on rank 0 and 2 on rank 1")):
        lines = [line for line in proc.stderr.splitlines() if "pipeflow-train" in line]
        assert proc.returncode == 2 and lines == [
            f"pipeflow-train: error: the ranks were started with different arguments: {says}; start every rank "
            "with the same pipeflow-train arguments"], proc.stderr
    assert max(mpi.seconds) < 30


def test_process_groups_give_up_after_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stages' and replicas' groups wait twice --timeout (the watchdog names a silent rank at --timeout, first):
    torch's default for a new group is 30 minutes under gloo, so two live ranks waiting on each other's transfers
    outlasted --timeout."""
    from pipeflow import comm

    made: list[dict[str, Any]] = []
    monkeypatch.setattr(comm.dist, "new_group", lambda ranks, **kw: made.append(kw) or tuple(ranks))
    world = comm.World(0, 2, 0, torch.device("cpu"), "gloo", None, timeout_s=7.0)  # type: ignore[arg-type]
    assert comm.new_groups(world, [[0, 1]]) == {(0, 1): (0, 1)}
    assert [kw["timeout"] for kw in made] == [timedelta(seconds=14)]


# ------------------------------------------------------------------------------ models


def empty_data(**kw: int) -> ModelSpec:
    """The mlp without a sample."""
    spec = mlp.build(**kw)
    spec.dataset = TensorDataset(torch.zeros(0, kw["d_in"]), torch.zeros(0, dtype=torch.long))
    return spec


def divides_by_zero(**kw: int) -> ModelSpec:
    """A builder with a bug of its own."""
    return mlp.build(layers=4 // kw["zero"])


def test_an_empty_dataset_and_a_builder_s_own_error_are_one_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the loader's ValueError traceback and MPI Abort (pipeflow-profile's through partitioner/layermem.py),
    and a ZeroDivisionError's traceback."""
    from partitioner.profiler import main as profile

    model = "tests.test_bad_input_train:empty_data"
    empty = f"model {model!r}: its dataset is empty; expected at least one (input, target) sample"
    with pytest.raises(ModelError) as e:
        build_model(model, MLP)
    assert str(e.value) == empty
    assert profile(["--model", model, "--model-args", json.dumps(MLP), "--microbatch-size", "4", "--device", "cpu",
                    "-o", str(tmp_path / "p.json")]) == 2
    assert capsys.readouterr().err == f"pipeflow-profile: error: {empty}\n"
    with pytest.raises(ModelError) as e:
        build_model("tests.test_bad_input_train:divides_by_zero", {"zero": 0})
    line = inspect.getsourcelines(divides_by_zero)[1] + 2
    assert str(e.value) == ("model 'tests.test_bad_input_train:divides_by_zero' failed to build with --model-args "
                            f"{{\"zero\": 0}}: ZeroDivisionError: integer division or modulo by zero (at {__file__}:"
                            f"{line})")


@pytest.mark.parametrize(("model", "args", "found"), [
    ("gpt", {"heads": 0}, "gpt needs heads >= 1 (an integer), found 0"),
    ("gpt", {"heads": 2.5}, "gpt needs heads >= 1 (an integer), found 2.5"),
    ("gpt", {"seq_len": 0}, "gpt needs seq_len >= 1 (an integer), found 0"),
    ("gpt", {"d_model": 0}, "gpt needs d_model >= 1 (an integer), found 0"),
    ("gpt", {"vocab": 0, "dataset": "synthetic"}, "gpt needs vocab >= 1 (an integer), found 0"),
    ("gpt", {"dataset": "synthetic", "dataset_size": 0}, "gpt needs dataset_size >= 1 (an integer), found 0"),
    ("gpt", {"layers": True}, "gpt needs layers >= 1 (an integer), found True"),
    ("gpt", {"tie": "x"}, "gpt needs tie to be true or false, found 'x'"),
    ("mlp", {"samples": 0}, "mlp needs samples >= 1 (an integer), found 0"),
    ("mlp", {"classes": 0}, "mlp needs classes >= 1 (an integer), found 0"),
    ("mlp", {"d_in": 0}, "mlp needs d_in >= 1 (an integer), found 0"),
    ("mlp", {"hidden": 0}, "mlp needs hidden >= 1 (an integer), found 0"),
    ("mlp", {"layers": 1}, "mlp needs layers >= 2 (an integer), found 1"),
])
def test_bad_built_in_model_arguments_are_one_line(model: str, args: dict[str, Any], found: str) -> None:
    """Before: ZeroDivisionError, IndexError and torch's tracebacks; a zero-size mlp trained with exit 0; any
    string counted as a true tie."""
    with pytest.raises(ModelError) as e:
        build_model(model, args)
    assert str(e.value) == f"model {model!r} cannot be built with --model-args {json.dumps(args)}: ValueError: {found}"


# ------------------------------------------------------------------------------ planning flags


@pytest.mark.parametrize(("argv", "message"), [
    (["--topology", "2y"], "--topology must be comma-separated levels COUNTxBANDWIDTH such as 8x300GB/s,4x25GB/s "
                           "(innermost first), found '2y'"),
    (["--topology", "2x1GB/s,2x1GB/s"], "--topology 2x1GB/s,2x1GB/s has 4 workers, but -np is 2; give levels whose "
                                        "counts multiply to 2"),
    (["--memory-per-worker", "lots"], "--memory-per-worker must be a size such as 16GB, 16GiB, 512MiB or 1e9, found "
                                      "'lots'"),
    *[(["--plan", "{t}/plan.json", *flag], f"{flag[0]} applies when planning on the spot, but --plan {{t}}/plan.json "
        f"gives the plan, which would run as it is; drop {flag[0]} (or pass it to pipeflow-plan and plan again)")
      for flag in (["--layers-per-stage", "2,2"], ["--topology", "2x1GB/s"], ["--straight"],
                   ["--memory-per-worker", "1GB"])],
    *[(["--layers-per-stage", "even", *flag], f"{flag[0]} applies when planning on the spot, but --layers-per-stage "
        f"even splits the layers by hand, which would run as it is; drop {flag[0]} (or --layers-per-stage to plan on "
        "the spot)") for flag in (["--topology", "2x1GB/s"], ["--straight"], ["--memory-per-worker", "1GB"])],
    (["--layers-per-stage", ""], "--layers-per-stage must be comma-separated integers, found ''"),
    (["--global-batch", "7", "--microbatch-size", "4"], "--global-batch 7 is not a multiple of --microbatch-size 4: a "
     "step is microbatch size x microbatches; pass a multiple of 4, or drop --microbatch-size to let the planner "
     "choose it"),
])
def test_planning_flags_are_checked_before_profiling_and_not_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     argv: list[str], message: str) -> None:
    """Before: --topology and --memory-per-worker were parsed after profiling on the spot (19 s for a gpt); with
    --plan the plan ran as it was whatever --layers-per-stage, --topology, --straight or --memory-per-worker said,
    and --global-batch 7 --microbatch-size 4 trained 7 microbatches of 1."""
    from partitioner import profiler
    from pipeflow.planning import make_plan
    from tests.test_global_batch import _OneHost

    monkeypatch.setattr(profiler, "profile_model", lambda *a, **kw: pytest.fail("profiled"))
    write_plan(tmp_path / "plan.json", "1f1b", 4, [(2, 1), (2, 1)])
    with pytest.raises(UsageError) as e:
        make_plan(flags(*(a.format(t=tmp_path) for a in argv)), build_model("mlp", MLP), 2, 0, _OneHost())
    assert str(e.value) == message.format(t=tmp_path)
    plan = make_plan(flags("--plan", str(tmp_path / "plan.json"), "--microbatches", "2", "--schedule", "gpipe"),
                     build_model("mlp", MLP), 2, 0, _OneHost())  # what --plan documents it takes
    assert (plan.microbatches, plan.schedule) == (2, "gpipe")


def test_global_batch_plans_at_the_microbatch_size_given() -> None:
    """DeepSpeed's rule: a global batch and a microbatch size given together must agree, and then both hold."""
    from pipeflow.planning import make_plan
    from tests.test_global_batch import _OneHost

    assert (flags().microbatch_size, flags("--global-batch", "8").microbatch_size) == (4, 0)  # 0: the planner's
    plan = make_plan(flags("--global-batch", "8", "--microbatch-size", "4", "--schedule", "1f1b"),
                     build_model("mlp", MLP), 2, 0, _OneHost())
    assert (plan.extra["planner"]["microbatch_size"], plan.microbatches) == (4, 2)
    with pytest.raises(config.ConfigError, match=r"^--microbatch-size must be >= 1, found 0$"):
        flags("--global-batch", "8", "--microbatch-size", "0")


# ------------------------------------------------------------------------------ flags and the checkpoint marker


@pytest.mark.parametrize(("argv", "message"), [
    (["--seed", "99999999999999999999999"], "--seed must be an integer from -2**63 to 2**64 - 1 (what "
                                            "torch.manual_seed takes), found 99999999999999999999999"),
    (["--seed", str(-2**63 - 1)], f"--seed must be an integer from -2**63 to 2**64 - 1 (what torch.manual_seed "
                                  f"takes), found {-2**63 - 1}"),
    (["--log-every", "-1"], "--log-every must be >= 1 steps (or 0: --steps / 10), found -1"),
])
def test_seed_and_log_every_out_of_range_are_refused(argv: list[str], message: str) -> None:
    """Before: 'Overflow when unpacking long long' without the flag's name; -1 taken as a modulus."""
    with pytest.raises(config.ConfigError) as e:
        flags(*argv)
    assert str(e.value) == message
    for seed in (str(2**64 - 1), str(-2**63), "0"):
        torch.manual_seed(int(flags("--seed", seed, "--log-every", "0").seed))


@pytest.mark.parametrize(("change", "found"), [
    ({"format": "pipeflow.checkpoint/9"}, "format 'pipeflow.checkpoint/9' (a str)"),
    ({"step": "1"}, "step '1' (a str)"),
    ({"run": None}, "run None (a NoneType)"),
    ({"stages": []}, "stages []"),
    ({"stages": [{"file": "stage-000.pt", "layers": [1, 1]}]}, "stages[0].layers [1, 1] (a list)"),
    ({"stages": [{"layers": [0, 1]}]}, "stages[0] without 'file'"),
])
def test_a_marker_of_another_format_says_what_it_holds(tmp_path: Path, change: dict[str, Any], found: str) -> None:
    from pipeflow import restore

    marker = {"format": CKPT_FORMAT, "step": 1, "run": {}, "stages": [{"file": "stage-000.pt", "layers": [0, 1]}],
              **change}
    (tmp_path / "COMPLETE").write_text(json.dumps(marker))
    with pytest.raises(CheckpointError) as e:
        restore.read_marker(tmp_path)
    assert str(e.value) == (f"{tmp_path}/COMPLETE: not a {CKPT_FORMAT} marker: expected an object with format, step, "
                            f"run and stages [{{file, layers: [start, end), bytes, sha256}}]; found {found}")


# ------------------------------------------------------------------------------ under mpirun


def outputs_end_to_end(d: Path) -> list[Case]:
    """Set-up errors every rank returns (exit 2): batched with check=False, in this order."""
    write_plan(d / "plan.json", "1f1b", 2, [(2, 1), (2, 1)])
    ck = ["--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "1"]
    train = [*BASE, "--plan", str(d / "plan.json"), "--microbatch-size", "2", "--steps", "1"]
    return [Case(2, [*train, "--save", str(d / "same.out"), "--trace", str(d / "same.out")], check=False),
            Case(2, [*train, "--save", str(d / "plan.json")], check=False),
            Case(2, [*train, *ck]),
            Case(2, [*train, *ck, "--steps", "2"], check=False)]


@batched(outputs_end_to_end)
def test_clashing_outputs_and_a_second_run_over_checkpoints_end_to_end(mpi: MpiRun) -> None:
    d = mpi.dir
    same, plan, _, again = mpi.procs
    for proc, want in [
        (same, f"pipeflow-train: error: --trace {d}/same.out: is also --save's path, so one output would overwrite "
               "the other; give each output its own path"),
        (plan, f"pipeflow-train: error: --save {d}/plan.json: is also --plan's path, an input of this run, which "
               "writing --save would overwrite; give --save another path"),
        (again, f"pipeflow-train: error: [rank 0] --checkpoint-dir {d}/ck holds the checkpoints of an earlier run "
                f"(the newest complete one: {d}/ck/step-000001), which this run would overwrite; pass --resume to "
                "continue it, or choose another --checkpoint-dir"),
    ]:
        lines = [line for line in proc.stderr.splitlines() if "pipeflow-train" in line]
        assert proc.returncode == 2 and lines == [want], proc.stderr
    assert json.loads((d / "plan.json").read_text())["format"] == "pipeflow.plan/1"
    assert not (d / "same.out").exists() and not (d / "ck" / "step-000002").exists()
