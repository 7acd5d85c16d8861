"""pipeflow.train.main runs many times in one process (tests/mpi_batch.py batches the distributed tests that
way): no run leaves state behind, a failing run does not stop the ones after it, and each keeps its own log level."""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeflow import train
from tests.conftest import Case, MpiRun, base_env, batched
from tests.reference import reference_flush

MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}
TRAIN = ["--model", "mlp", "--model-args", json.dumps(MLP), "--layers-per-stage", "even", "--microbatches", "4",
         "--microbatch-size", "2", "--optimizer", "sgd", "--lr", "0.05", "--dtype", "float64", "--device", "cpu",
         "--steps", "3"]
# A NaN input at sample 16: with --no-shuffle, step 3's first microbatch. Flush schedules stop all ranks
# together at that step (exit 4) and return from main, with the process group and signal handlers set up.
NAN = ["--model", "tests.models:nan_mlp", "--model-args", json.dumps(MLP), "--no-shuffle",
       "--layers-per-stage", "even", "--microbatches", "4", "--microbatch-size", "2", "--device", "cpu",
       "--steps", "5", "--optimizer", "sgd", "--lr", "0.05"]
NAN_STOP = ("pipeflow-train: non-finite loss on stage {last} (the last) and gradients on stages {stages} at step 3; "
            "the update was not applied")


def test_main_leaves_no_process_state_behind(tmp_path, monkeypatch):
    """One process (a world of one, no mpirun): a stopped run and a finished one restore the global RNG,
    the default dtype, the SIGTERM/SIGINT handlers and the logging set-up, and the second run trains
    exactly like one process does."""
    monkeypatch.setenv("PIPEFLOW_LOG", "WARNING")
    torch.manual_seed(1234)
    rng, dtype, level = torch.get_rng_state(), torch.get_default_dtype(), logging.getLogger().level
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    assert train.main(NAN) == 4
    root = logging.getLogger()
    n_handlers = len(root.handlers)
    assert torch.equal(torch.get_rng_state(), rng), "build_model's seed leaked out of the run"
    assert torch.get_default_dtype() == dtype
    assert logging.getLogger().level == level
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "the stop left pipeflow's signal handlers"
    assert not torch.distributed.is_initialized()
    out = tmp_path / "model.pt"
    assert train.main([*TRAIN, "--save", str(out)]) == 0
    assert len(root.handlers) == n_handlers  # logging is set up once
    assert torch.equal(torch.get_rng_state(), rng)
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    got = torch.load(out, weights_only=True)
    want = reference_flush("mlp", MLP, steps=3, microbatches=4, microbatch_size=2, optimizer="sgd", lr=0.05)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)


def failures_then_runs(d: Path) -> list[Case]:
    return [Case(2, [*TRAIN, "--steps", "0"], check=False),                       # usage: exit 2
            Case(2, NAN, check=False),                                             # agreed stop: exit 4
            Case(2, [*TRAIN, "--save", str(d / "a.pt")], env={"PIPEFLOW_LOG": "INFO"}),
            Case(2, [*TRAIN, "--seed", "1", "--save", str(d / "b.pt")]),
            Case(2, [*TRAIN, "--save", str(d / "c.pt")])]


@batched(failures_then_runs)
def test_failed_runs_do_not_disturb_the_next_in_one_job(mpi: MpiRun):
    """Under -np 2 in one batch: a usage error and a stopped run return their codes, and the runs after
    them (a new process group, watchdog and log level each) train exactly like one process; the same
    flags give the same bits after another seed's run."""
    usage, stopped, a, b, c = mpi.procs
    assert usage.returncode == 2 and "--steps must be >= 1, found 0" in usage.stderr, usage.stderr
    assert stopped.returncode == 4, stopped.stderr
    assert NAN_STOP.format(last=1, stages="0, 1") in stopped.stderr, stopped.stderr
    assert "processes by rank" in a.stderr, a.stderr  # PIPEFLOW_LOG=INFO for that run only
    assert "processes by rank" not in b.stderr + c.stderr
    assert "Traceback" not in a.stderr + b.stderr + c.stderr
    want = reference_flush("mlp", MLP, steps=3, microbatches=4, microbatch_size=2, optimizer="sgd", lr=0.05)
    got_a, got_b, got_c = (torch.load(mpi.dir / f"{x}.pt", weights_only=True) for x in "abc")
    for k in want:
        torch.testing.assert_close(got_a[k], want[k], rtol=1e-9, atol=1e-11)
        assert torch.equal(got_a[k], got_c[k]), k
    assert any(not torch.equal(got_a[k], got_b[k]) for k in want)  # --seed 1 is another run


def test_a_test_s_processes_find_the_tests_package_from_any_directory(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A background launch (`python -m tests.api_failing_layer`) started while a foreground test had changed
    directory found no module `tests`: base_env puts the repository first on PYTHONPATH."""
    monkeypatch.chdir(tmp_path)
    proc = subprocess.run([sys.executable, "-c", "import tests"], env=base_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
