"""Predicted against measured step time on CPU: profile, plan, train under mpirun, compare (issue 13).

    python benchmarks/planner/accuracy.py              # the table of benchmarks/planner/README.md
    python benchmarks/planner/accuracy.py --quick      # the first case only

Each case runs the three commands a user runs: `pipeflow-profile` (1 torch thread, as a rank), `pipeflow-plan`
(the simulator's step time is `predicted.step_ms` in plan.json) and `mpirun -np N pipeflow-train --plan` (the
steady-state samples/s it logs, steps 3 on, give the measured step time m * b / samples/s). The machine's
load average is printed before and after: on a shared machine the measured times are not the model's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# (model, model args, workers, microbatch size, microbatches, schedule, steps)
CASES = [
    ("mlp", {"layers": 8, "hidden": 512}, 2, 32, 8, "1f1b", 30),
    ("mlp", {"layers": 8, "hidden": 512}, 2, 32, 8, "gpipe", 30),
    ("mlp", {"layers": 8, "hidden": 2048}, 2, 32, 8, "1f1b", 10),
    ("gpt", {"layers": 4, "d_model": 128, "heads": 4, "seq_len": 64, "dataset": "synthetic", "dataset_size": 4096},
     2, 8, 8, "1f1b", 20),
]
STEADY = re.compile(r"steady state \(steps \d+-\d+\): ([\d.]+) samples/s")


def run(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPEFLOW_LOG": "INFO"}
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout + r.stderr


def case(model: str, args: dict[str, object], workers: int, b: int, m: int, schedule: str, steps: int,
         tmp: Path) -> tuple[str, float, float]:
    py = sys.executable
    margs = json.dumps(args)
    run([py, "-m", "partitioner.profiler", "--model", model, "--model-args", margs, "--microbatch-size", str(b),
         "--device", "cpu", "--threads", "1", "--repeats", "10", "-o", "profile.json"], tmp)
    run([py, "-m", "partitioner.cli", "profile.json", "--workers", str(workers), "--schedule", schedule,
         "--microbatches", str(m), "-o", "plan.json"], tmp)
    plan = json.loads((tmp / "plan.json").read_text())
    out = run(["mpirun", "-np", str(workers), py, "-m", "pipeflow.train", "--model", model, "--model-args", margs,
               "--plan", "plan.json", "--steps", str(steps), "--microbatch-size", str(b), "--device", "cpu"], tmp)
    found = STEADY.findall(out)
    if not found:
        raise SystemExit(f"no steady-state line in the training log:\n{out[-2000:]}")
    measured = m * b / float(found[-1]) * 1e3
    shape = "-".join(str(st["replicas"]) for st in plan["stages"])
    return shape, float(plan["predicted"]["step_ms"]), measured


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    print(f"# load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| model | workers | schedule | b x m | replicas per stage | predicted ms | measured ms | error |")
    print("|---|---:|---|---|---|---:|---:|---:|")
    for model, args, workers, b, m, schedule, steps in CASES[:1] if a.quick else CASES:
        with tempfile.TemporaryDirectory() as d:
            shape, pred, meas = case(model, args, workers, b, m, schedule, steps, Path(d))
        print(f"| {model} {json.dumps(args)} | {workers} | {schedule} | {b} x {m} | {shape} | {pred:.2f} | "
              f"{meas:.2f} | {100 * (pred / meas - 1):+.0f}% |", flush=True)
    print(f"# load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
