"""Shared helpers: run pipeflow under mpirun with a timeout, and single-process references."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MPIRUN = os.environ.get("PIPEFLOW_MPIRUN") or shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PIPEFLOW_LOG="WARNING")
    return env


def run_mpi(np: int, args: list[str], *, timeout: float = 180, module: str = "pipeflow.train",
            check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`mpirun -np N python -m module args`; a hang fails the test through the timeout."""
    if MPIRUN is None:
        pytest.fail("mpirun not found: install the package (it depends on mpich) or set PIPEFLOW_MPIRUN")
    cmd = [MPIRUN, "-np", str(np), sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**mpi_env(), **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
                             f"stderr:\n{proc.stderr}")
    return proc


def write_plan(path: Path, schedule: str, m: int, stages: list[tuple[int, int]]) -> int:
    """A plan.json of consecutive (layer count, replicas) stages with ranks in order; returns the workers."""
    ranks, out, start = 0, [], 0
    for layers, reps in stages:
        out.append({"layers": [start, start + layers], "replicas": reps, "ranks": list(range(ranks, ranks + reps))})
        start += layers
        ranks += reps
    path.write_text(json.dumps({"format": "pipeflow.plan/1", "schedule": schedule, "microbatches": m,
                                "workers": ranks, "stages": out}))
    return ranks
