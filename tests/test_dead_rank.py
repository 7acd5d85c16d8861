"""A rank killed without a word (kill -9, OOM killer) is named under pipeflow-launch (issue 11, README
"Failures"): MPICH's mpirun ends the job at once, so the launcher names the rank whose pid vanished first."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch.cli import RankWatch
from tests.conftest import MPIRUN, in_background, mpi_env, write_plan

MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}
TIMEOUT = 5  # pipeflow-train --timeout


@in_background
def test_sigkill_of_a_rank_under_pipeflow_launch_names_it(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    write_plan(plan, "1f1b", 4, [(2, 1), (2, 1), (2, 1)])
    pids = tmp_path / "pids"
    pids.mkdir()
    train = ["--model", "mlp", "--model-args", json.dumps(MLP), "--microbatch-size", "2", "--device", "cpu",
             "--steps", "1000000", "--timeout", str(TIMEOUT)]
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "--plan", str(plan), "--mpirun", str(MPIRUN),
                             "--env", f"PIPEFLOW_PID_DIR={pids}", "--", *train],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env())
    deadline = time.monotonic() + 120
    while len(list(pids.iterdir())) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(4)  # set-up done, training
    ranks = {int(f.stem[4:]): int(f.read_text()) for f in pids.iterdir()}
    os.kill(ranks[2], signal.SIGKILL)
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=TIMEOUT + 30)
    finally:
        proc.kill()
        for pid in ranks.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert time.monotonic() - t0 < TIMEOUT + 5
    lines = [line for line in err.splitlines() if line.startswith(("pipeflow-launch: error", "pipeflow-train"))]
    assert lines == [f"pipeflow-launch: error: rank 2 (pid {ranks[2]}) died first, without a message from "
                     f"pipeflow-train (killed by a signal or crashed; mpirun exited 9), and mpirun ended the other "
                     "ranks"], err
    assert proc.returncode == 9


def test_rank_watch_names_the_first_pid_to_vanish_and_stays_quiet_after_pipeflow_spoke(tmp_path: Path) -> None:
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        (tmp_path / "rank0.pid").write_text(str(alive.pid))
        (tmp_path / "rank1.pid").write_text(str(dead.pid))
        watch = RankWatch(tmp_path, 2)
        watch.poll()
        assert watch.first_dead == (1, dead.pid)
        alive.kill()
        alive.wait()
        watch.poll()
        assert watch.first_dead == (1, dead.pid)  # the first stays the first
        assert watch.explain(11) is not None and "rank 1 " in str(watch.explain(11))
        for rc in (0, 2, 3, 4, 130, 143):  # pipeflow-train said why itself
            assert watch.explain(rc) is None
    finally:
        alive.kill()
