"""Bad input to pipeflow-train: one line, exit 2, within seconds, before any process group is made
(issue 11). Most cases call the validation directly; a few end-to-end runs check the wiring: the line is
written once (rank 0) and whole, under PYTHONUNBUFFERED=1 as pipeflow-launch sets it."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from os import popen  # noqa: F401  (re-exported standard-library function: must be refused as a builder)
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from partitioner.plan import PlanError, even_plan
from pipeflow import config
from pipeflow.models import mlp
from pipeflow.schedule import SCHEDULES
from pipeflow.spec import ModelError, ModelSpec, build_model, resolve_builder
from pipeflow.train import build_parser, check_args, main
from tests.conftest import MPIRUN, Case, MpiRun, batched, in_background, mpi_env, run_mpi, write_plan
from tests.reference import reference_flush

MLP = {"layers": 4, "hidden": 8, "d_in": 4, "samples": 64}
BASE = ["--model", "mlp", "--model-args", json.dumps(MLP), "--device", "cpu", "--layers-per-stage", "even"]


def nan_data_mlp(**kw: int) -> ModelSpec:
    """The mlp on all-NaN inputs: every step is non-finite, the run never recovers."""
    spec = mlp.build(**kw)
    x, y = spec.dataset.tensors  # type: ignore[attr-defined]
    spec.dataset = TensorDataset(torch.full_like(x, float("nan")), y)
    return spec


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--lr", "-1"], {}, "--lr must be a finite number >= 0, found -1.0"),
    (["--lr", "nan"], {}, "--lr must be a finite number >= 0, found nan"),
    (["--lr", "inf"], {}, "--lr must be a finite number >= 0, found inf"),
    (["--optimizer", "sgd", "--momentum", "-1"], {}, "--momentum must be a finite number >= 0, found -1.0"),
    (["--weight-decay", "-0.1"], {}, "--weight-decay must be a finite number >= 0, found -0.1"),
    (["--weight-decay", "nan"], {}, "--weight-decay must be a finite number >= 0, found nan"),
    (["--max-skips", "-1"], {}, "--max-skips must be >= 0 (0: never stop), found -1"),
    (["--timeout", "inf"], {}, "--timeout must be a finite number of seconds > 0, found inf"),
    (["--timeout", "nan"], {}, "--timeout must be a finite number of seconds > 0, found nan"),
    (["--microbatches", "100000000"], {}, "--microbatches gives 100000000 microbatches in one schedule, more than "
                                          "the 1000000 pipeflow can build"),
    ([], {"PIPEFLOW_LOG": "verbose"}, "PIPEFLOW_LOG must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (or a "
                                      "number), found 'verbose'"),
    ([], {"PIPEFLOW_P2P_MAX_CTAS": "x"}, "PIPEFLOW_P2P_MAX_CTAS must be an integer >= 0 (CTAs per NCCL "
                                         "point-to-point channel; 0: NCCL's choice), found 'x'"),
    ([], {"PIPEFLOW_P2P_MAX_CTAS": "-2"}, "PIPEFLOW_P2P_MAX_CTAS must be an integer >= 0"),
    ([], {"PIPEFLOW_STACK_DUMP_S": "soon"}, "PIPEFLOW_STACK_DUMP_S must be a number of seconds > 0, found 'soon'"),
    ([], {"PIPEFLOW_REDUCE_INPLACE": "0"}, "PIPEFLOW_REDUCE_INPLACE must be an integer >= 1 (elements from which a "
                                           "gradient is all-reduced in place), found '0'"),
    ([], {"PIPEFLOW_REDUCE_LATE": "yes"}, "PIPEFLOW_REDUCE_LATE must be 1 (a deferred update's all-reduce under the "
                                          "next minibatch) or 0 (beside the last backward), found 'yes'"),
    ([], {"PIPEFLOW_REDUCE": "nvlink"}, "PIPEFLOW_REDUCE must be one of nccl, ce, found 'nvlink'"),
])
def test_bad_flags_and_environment_are_refused_in_one_line(monkeypatch, argv, env, message):
    for name in ("PIPEFLOW_LOG", "PIPEFLOW_P2P_MAX_CTAS", "PIPEFLOW_STACK_DUMP_S", "PIPEFLOW_REDUCE_INPLACE",
                 "PIPEFLOW_REDUCE_LATE", "PIPEFLOW_REDUCE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args([*BASE, *argv])
    with pytest.raises(ValueError) as e:
        check_args(args)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_good_values_pass(monkeypatch):
    monkeypatch.setenv("PIPEFLOW_LOG", "debug")  # any case, as logging's own names
    monkeypatch.setenv("PIPEFLOW_P2P_MAX_CTAS", "0")
    check_args(build_parser().parse_args([*BASE, "--lr", "0", "--optimizer", "sgd", "--momentum", "0.9",
                                          "--microbatches", "1000000"]))
    assert config.log_level("debug") == 10 and config.log_level(None) == 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a GPU")
def test_device_cuda_without_a_gpu_is_a_usage_error():
    with pytest.raises(config.ConfigError, match=r"^--device cuda needs a GPU, but torch.cuda.is_available\(\) is "
                                                 r"False on this host"):
        check_args(build_parser().parse_args([*BASE, "--device", "cuda"]))


def test_plan_schedule_and_action_list_size_are_checked_at_setup():
    # The plan itself refuses a schedule pipeflow does not know (partitioner/plan.py: Plan.validate)...
    with pytest.raises(PlanError, match=r"^plan\.schedule must be one of gpipe, 1f1b, async, 2bw, interleaved, zb, "
                                        r"zb-h2, found 'zb-h3'$"):
        even_plan(4, 2, schedule="zb-h3", microbatches=4)
    # async runs all --steps as one list without --checkpoint-dir: 8 x 1000000 microbatches cannot be built...
    args = build_parser().parse_args([*BASE, "--schedule", "async", "--steps", "1000000"])
    with pytest.raises(config.ConfigError, match=r"^--schedule async with 8 microbatches x 1000000 steps per segment "
                                                 r"gives 8000000 microbatches in one schedule.*--checkpoint-every K"):
        config.check_plan(even_plan(4, 2, schedule="async", microbatches=8), args, SCHEDULES)
    # ...in segments of 100 steps they can.
    args = build_parser().parse_args([*BASE, "--schedule", "async", "--steps", "1000000", "--checkpoint-dir", "ck",
                                      "--checkpoint-every", "100"])
    assert config.check_plan(even_plan(4, 2, schedule="async", microbatches=8), args, SCHEDULES) == 800


def test_parse_errors_are_one_line_written_once(monkeypatch, capfd):
    """argparse's own errors come before MPI: only the launcher's rank 0 says them, in one line (main in
    this process: the error comes before mpi4py is imported)."""
    outs = []
    for rank in ("0", "1"):
        monkeypatch.setenv("PMI_RANK", rank)
        with pytest.raises(SystemExit) as e:
            main(["--lr", "fast"])
        assert e.value.code == 2
        captured = capfd.readouterr()
        assert captured.out == ""
        outs.append(captured.err)
    assert outs == ["pipeflow-train: error: argument --lr: invalid float value: 'fast' (see pipeflow-train --help)\n",
                    ""]


class _Samples(torch.utils.data.Dataset):
    def __init__(self, make):
        self.make = make

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.make(i)


def sampled(kind: str) -> ModelSpec:
    """The mlp on a dataset whose samples are `kind`: a dict, a triple, or a pair whose input is a dict."""
    make = {"dict": lambda i: {"x": torch.zeros(4), "y": 0}, "triple": lambda i: (torch.zeros(4), 0, 1),
            "dict input": lambda i: ({"x": torch.zeros(4)}, 0), "pair": lambda i: (torch.zeros(4), 0),
            "tensor": lambda i: torch.zeros(4)}[kind]
    spec = mlp.build(**MLP)
    spec.dataset = _Samples(make)
    return spec


PAIRS = "its dataset's samples must be (input, target) pairs, each a tensor, a number, or a tuple or dict of them"


@pytest.mark.parametrize(("kind", "message"), [
    ("dict", f"{PAIRS}; sample 0 is a dict (return (inputs, target) from __getitem__; inputs may be a dict)"),
    ("triple", f"{PAIRS}; sample 0 has 3 parts"),
    ("tensor", f"{PAIRS}; sample 0 is a Tensor"),
])
def test_samples_that_are_not_input_target_pairs_are_refused_at_set_up(kind: str, message: str) -> None:
    """Before, the loader stopped the first stage at its first microbatch with a TypeError's traceback."""
    with pytest.raises(ModelError) as e:
        build_model("tests.test_bad_input:sampled", {"kind": kind})
    assert str(e.value) == f"model 'tests.test_bad_input:sampled': {message}"
    assert build_model("tests.test_bad_input:sampled", {"kind": "pair"}).dataset[0][1] == 0
    assert build_model("tests.test_bad_input:sampled", {"kind": "dict input"}).dataset[0][1] == 0


def test_builders_that_are_not_python_functions_of_user_code_are_refused(tmp_path):
    marker = tmp_path / "marker"
    for model, what in [("os:system", "names Python's standard library"),
                        ("subprocess:run", "names Python's standard library"),
                        ("tests.test_bad_input:popen", "is a function of Python's standard library (os)"),
                        ("torch.nn:Linear", "is a class"),
                        ("pipeflow.train:log", "is a Logger, not a Python function")]:
        with pytest.raises(ModelError) as e:
            build_model(model, {"command": f"touch {marker}"})
        assert f"--model {model!r} {what}" in str(e.value)
    assert not marker.exists()
    assert resolve_builder("tests.test_bad_input:nan_data_mlp") is nan_data_mlp
    assert "runs that code" in " ".join(build_parser().format_help().split())


def bad_setups(d: Path) -> list[Case]:
    """Runs that stop at set-up (exit 2, no MPI Abort) or stop together at a step (exit 4): batched, with
    check=False; the names are the tests' cases, in this order."""
    zb = d / "zb.json"
    write_plan(zb, "zb-h3", 4, [(2, 1), (2, 1)])
    nan = ["--model", "tests.test_bad_input:nan_data_mlp", "--model-args", json.dumps(MLP), "--device", "cpu",
           "--layers-per-stage", "even", "--optimizer", "sgd", "--microbatches", "2", "--steps", "50",
           "--skip-nonfinite", "--max-skips", "3"]
    marker = d / "marker"
    return [Case(2, ["--model", "os:system", "--model-args", json.dumps({"command": f"touch {marker}"})], check=False),
            Case(2, [*BASE[:BASE.index("--layers-per-stage")], "--plan", str(zb)], env={"PIPEFLOW_LOG": "INFO"},
                 check=False),
            Case(2, [*BASE, "--microbatches", "100000000"], check=False),
            Case(2, nan, check=False),
            Case(2, BASE, env={"PIPEFLOW_LOG": "verbose"}, check=False),
            Case(2, BASE, env={"PIPEFLOW_CUDA_GRAPHS": "1"}, check=False)]


@batched(bad_setups)
def test_bad_setups_end_to_end_print_one_whole_line(mpi: MpiRun):
    """Under mpirun: exactly one error line, from rank 0; --model os:system does not run the command; an
    unknown plan schedule stops at set-up on every rank; CUDA graphs asked for on CPUs are refused there;
    --skip-nonfinite on a run that never recovers stops after --max-skips with the count. (That mpirun forwards
    the line whole under PYTHONUNBUFFERED=1 is test_set_up_error_under_mpirun_is_one_whole_line's.)"""
    runs = dict(zip(["os:system", "zb", "huge m", "nan", "log level", "graphs"], mpi.procs))
    for name, want, code in [
        ("os:system", "pipeflow-train: error: --model 'os:system' names Python's standard library, which has no "
                      "model builder: expected 'package.module:function' of your own code returning a "
                      "pipeflow.ModelSpec", 2),
        ("zb", f"pipeflow-train: error: {mpi.dir / 'zb.json'}: plan.schedule must be one of gpipe, 1f1b, async, 2bw, "
               "interleaved, zb, zb-h2, found 'zb-h3'", 2),
        ("huge m", "pipeflow-train: error: --microbatches gives 100000000 microbatches in one schedule", 2),
        ("nan", "pipeflow-train: non-finite loss on stage 1 (the last) and gradients on stages 0, 1 at step 3: "
                "3 consecutive steps skipped (3 in all; --skip-nonfinite stops after --max-skips 3 in a row), "
                "the run is not recovering. Lower --lr or check the data", 4),
        ("log level", "pipeflow-train: error: PIPEFLOW_LOG must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (or "
                      "a number), found 'verbose'", 2),
        ("graphs", "pipeflow-train: error: PIPEFLOW_CUDA_GRAPHS=1 replays CUDA graphs, but the ranks run on the CPU "
                   "(--device cpu); unset it", 2),
    ]:
        proc = runs[name]
        err = proc.stderr
        lines = [line for line in err.splitlines() if "pipeflow-train" in line]
        assert proc.returncode == code and len(lines) == 1 and lines[0].startswith(want), (name, err)
        assert "Traceback" not in err, err
    assert "[rank" not in runs["zb"].stderr, "set-up must stop before any rank starts training"
    assert not (mpi.dir / "marker").exists()
    assert max(mpi.seconds) < 120


@in_background
def test_set_up_error_under_mpirun_is_one_whole_line(tmp_path):
    """A launch of its own: 4 ranks under mpirun with PYTHONUNBUFFERED=1, as pipeflow-launch sets it; the
    error line reaches mpirun's stderr once and whole, not glued to another rank's output."""
    marker = tmp_path / "marker"
    proc = run_mpi(4, ["--model", "os:system", "--model-args", json.dumps({"command": f"touch {marker}"})],
                   timeout=240, check=False)
    lines = [line for line in proc.stderr.splitlines() if "pipeflow-train" in line]
    assert proc.returncode == 2 and lines == [
        "pipeflow-train: error: --model 'os:system' names Python's standard library, which has no model builder: "
        "expected 'package.module:function' of your own code returning a pipeflow.ModelSpec"], proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()


def many_microbatches(d: Path) -> Case:
    return Case(2, [*BASE, "--microbatches", "512", "--microbatch-size", "1", "--steps", "1", "--optimizer", "sgd",
                    "--lr", "0.05", "--dtype", "float64", "--save", str(d / "m.pt")])


@batched(many_microbatches)
def test_more_samples_per_step_than_the_dataset_starts_at_once_and_trains_right(mpi: MpiRun):
    """512 microbatches of 1 over 64 samples: the loader cycles (each sample 8 times a step); one step
    equals the single-process reference, and set-up is not slowed by m."""
    want = reference_flush("mlp", MLP, steps=1, microbatches=512, microbatch_size=1, lr=0.05)
    got = torch.load(mpi.dir / "m.pt", weights_only=True)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12)
    assert mpi.seconds[0] < 90


@in_background
def test_ctrl_c_of_mpirun_during_async_without_checkpoint_dir_stops_cleanly(tmp_path):
    """Today: 7 tracebacks, a segfault and exit 11. Now: exit 130 and one line, as with --checkpoint-dir."""
    args = [*BASE, "--schedule", "async", "--microbatches", "2", "--steps", "5000", "--log-every", "1",
            "--timeout", "30"]
    env = {**mpi_env(), "PIPEFLOW_LOG": "INFO"}
    proc = subprocess.Popen([str(MPIRUN), "-np", "2", sys.executable, "-m", "pipeflow.train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = time.monotonic() + 150
    while not any("loss" in line for line in lines) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "".join(lines)  # training, far from its end
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    try:
        proc.wait(timeout=30)
    finally:
        proc.kill()
    took = time.monotonic() - t0
    reader.join(10)
    err = "".join(lines)
    msgs = [line for line in lines if line.startswith("pipeflow-train")]
    assert len(msgs) == 1 and msgs[0].startswith("pipeflow-train: stopped by SIGINT (received by rank "), err
    assert msgs[0].rstrip().endswith("nothing saved: the asynchronous schedules checkpoint only with "
                                     "--checkpoint-dir"), err
    assert "Traceback" not in err and "Segmentation" not in err and "signal 11" not in err, err
    assert proc.returncode == 130, err
    assert took < 15


@pytest.mark.parametrize("loss_fn, found", [
    (torch.nn.CrossEntropyLoss(reduction="none"), r"loss_fn returned a tensor of shape \(4,\) and dtype float32$"),
    (lambda out, y: (out.argmax(1) == y).sum(), r"loss_fn returned a tensor of shape \(\) and dtype int64$"),
    (lambda out, y: torch.nn.functional.cross_entropy(out, y).item(), r"loss_fn returned a float$"),
    (lambda out, y: torch.nn.functional.cross_entropy(out.detach(), y), r"^the loss needs a gradient to train on, "
     r"but loss_fn returned a tensor that does not require grad: was it computed under torch.no_grad\(\), or from "
     r"\.detach\(\)ed outputs\?$")])
def test_a_loss_that_is_not_one_differentiable_number_stops_at_the_first_forward(loss_fn, found) -> None:
    """A per-sample loss (reduction="none"), an integer count, a Python float or a detached loss: the last stage
    stopped at its first backward with autograd's traceback on its rank alone; now its first forward raises one
    line (a UsageError: exit 2 under pipeflow-train), before any backward or update."""
    from pipeflow.stage import Stage

    stage = Stage([torch.nn.Linear(3, 5)], start=1, first=False, last=True, loss_fn=loss_fn,
                  device=torch.device("cpu"))
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(ValueError, match=found):
        stage.forward(0, [x], torch.tensor([0, 1, 2, 3]))
