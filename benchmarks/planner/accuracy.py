"""Predicted against measured step time on CPU: profile, plan, train under mpirun, compare (issue 13).

    python benchmarks/planner/accuracy.py              # the table of benchmarks/planner/README.md
    python benchmarks/planner/accuracy.py --quick      # the first case only
    python benchmarks/planner/accuracy.py --global-batch 64   # the microbatch size pipeflow-plan picks
    python benchmarks/planner/accuracy.py --schedule async    # every case under async (and update_ms)
    python benchmarks/planner/accuracy.py --trials 3          # all of it three times, each case's median error

Each case runs the three commands a user runs: `pipeflow-profile` (1 torch thread, as a rank), `pipeflow-plan`
(the simulator's step time is `predicted.step_ms` in plan.json) and `mpirun -np N pipeflow-train --plan` (the
steady-state samples/s it logs, steps 3 on, give the measured step time m * b / samples/s; the fastest of
--runs runs). Each command waits for the CPUs to be idle (>= 90 %, other users between their jobs); the load
average is printed before and after: on a shared machine the measured times are not the model's.

First, once, the runtime's own costs on this machine are calibrated (partitioner/calibrate.py) from traced
runs of the first case, a straight pipeline and data parallelism, and a straight pipeline of CONTRAST, a model
whose stages hold half the layers of the first case's, read together (`calibrate --also`), --runs times, the
reading of the run whose straight pipeline stepped fastest kept whole (`--pick median`: the median run's):
`action_ms` and `layer_ms` (ranks holding 2, 4 and 8 layers: a cost per layer call, dispatch, is told
from a cost per action; `--no-contrast` leaves CONTRAST out, as before 2026-11-28), `message_ms`,
`latency_ms`, `step_gap_ms` and `link_bandwidth` (the all-reduce between ranks). Every case is then planned
twice, from its profile as pipeflow-profile wrote it ("profile only") and with the calibrated numbers added
("calibrated"), and trained on the calibrated plan.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from partitioner.plan import Plan, StagePlan
from partitioner.profile import CALIBRATED

# (model, model args, workers, microbatch size, microbatches, schedule, steps)
CASES = [
    ("mlp", {"layers": 8, "hidden": 512}, 2, 32, 8, "1f1b", 30),
    ("mlp", {"layers": 8, "hidden": 512}, 2, 32, 8, "gpipe", 30),
    ("mlp", {"layers": 8, "hidden": 2048}, 2, 32, 8, "1f1b", 10),
    ("gpt", {"layers": 4, "d_model": 128, "heads": 4, "seq_len": 64, "dataset": "synthetic", "dataset_size": 4096},
     2, 8, 8, "1f1b", 20),
    ("mlp", {"layers": 4, "hidden": 1024}, 2, 16, 4, "gpipe", 20),
]
CONCURRENT = False  # --concurrent-profile
TIMING = "idle"  # --timing
PICK = "fastest"  # --pick: which calibration reading is kept
ROUNDS = 3  # --rounds: pipeflow-profile --rounds
STEADY = re.compile(r"steady state \(steps \d+-\d+\): ([\d.]+) samples/s")


def wait_idle(limit_s: float = 900.0) -> None:
    """Wait until the CPUs are >= 90 % idle over 2 s, twice in a row (other users of a shared machine
    between their jobs), or `limit_s` passed; no-op without /proc/stat."""
    def ticks() -> tuple[int, int]:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
        return v[3] + v[4], sum(v)
    if not Path("/proc/stat").exists():
        return
    quiet, t0 = 0, time.monotonic()
    while quiet < 2 and time.monotonic() - t0 < limit_s:
        (i0, a0), _, (i1, a1) = ticks(), time.sleep(2), ticks()
        quiet = quiet + 1 if (i1 - i0) >= 0.9 * (a1 - a0) else 0


def run(cmd: list[str], cwd: Path) -> str:
    wait_idle()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPEFLOW_LOG": "INFO"}
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout + r.stderr


def profile(model: str, args: dict[str, object], b: int, ranks: int, tmp: Path) -> None:
    """profile.json from pipeflow-profile; with ranks > 1 (`--concurrent-profile`) its `contention` too, measured
    beside ranks - 1 busy companions (`--ranks-per-host`): two ranks on two cores share the L3 and the memory
    bandwidth (README, "What remains")."""
    run([sys.executable, "-m", "partitioner.profiler", "--model", model, "--model-args", json.dumps(args),
         "--microbatch-size", str(b), "--device", "cpu", "--threads", "1", "--repeats", "10", "--timing", TIMING,
         "--rounds", str(ROUNDS), "--ranks-per-host", str(ranks), "-o", "profile.json"], tmp)


def profile_and_plan(model: str, args: dict[str, object], workers: int, b: int, m: int, schedule: str, tmp: Path,
                     runtime: dict[str, float] | None) -> tuple[dict, dict]:
    """The plan from the profile alone, and (with `runtime`) from the profile with the calibrated costs."""
    py = sys.executable
    profile(model, args, b, workers if CONCURRENT else 1, tmp)
    plans = []
    for name, extra in (("plan.json", None), ("calibrated.json", runtime)):
        prof = json.loads((tmp / "profile.json").read_text())
        (tmp / "planned.json").write_text(json.dumps({**prof, **(extra or {})}))
        run([py, "-m", "partitioner.cli", "planned.json", "--workers", str(workers), "--schedule", schedule,
             "--microbatches", str(m), "-o", name], tmp)
        plans.append(json.loads((tmp / name).read_text()))
    return plans[0], plans[1]


def train(model: str, args: dict[str, object], workers: int, b: int, m: int, steps: int, plan: str, tmp: Path,
          *extra: str, runs: int = 1) -> float:
    """The measured step time (ms) of pipeflow-train on `plan`: the fastest of `runs` runs (another user's
    burst on a shared machine only ever slows a run down)."""
    return min(_train(model, args, workers, b, m, steps, plan, tmp, *extra) for _ in range(runs))


def _train(model: str, args: dict[str, object], workers: int, b: int, m: int, steps: int, plan: str, tmp: Path,
           *extra: str) -> float:
    out = run(["mpirun", "-np", str(workers), sys.executable, "-m", "pipeflow.train", "--model", model,
               "--model-args", json.dumps(args), "--plan", plan, "--steps", str(steps), "--microbatch-size", str(b),
               "--device", "cpu", *extra], tmp)
    found = STEADY.findall(out)
    if not found:
        raise SystemExit(f"no steady-state line in the training log:\n{out[-2000:]}")
    return m * b / float(found[-1]) * 1e3


# Unless --no-contrast: a model whose straight stages hold half the layers of the first case's (two against
# four), traced too, so that the calibration's fit tells a cost per layer call from one per action.
CONTRAST = ("mlp", {"layers": 4, "hidden": 768}, 32)


def calibration(tmp: Path, runs: int, updates: bool = False, contrast: bool = True) -> dict[str, float]:
    """The runtime's costs from traced runs of the first case as a straight pipeline (every stage sends) and as
    data parallelism (link_bandwidth: the all-reduce between ranks) and, with `contrast`, of CONTRAST as a straight
    pipeline, each run's traces read together (action_ms and layer_ms apart: ranks of 2, 4 and 8 layers), `runs`
    times: one run's reading moved by up to 4x between runs on this machine. One reading is kept whole: the
    reading of the run whose traced straight pipeline stepped fastest (PICK "fastest": a burst of another user
    only ever slows a run, as train() keeps the fastest run), or of the median run (PICK "median"). Its numbers
    are fitted together (latency_ms is what the others leave of that run's step, action_ms and layer_ms one fit),
    so each number's own median mixed readings: three readings of (0, 0), (0.162, 0) and (0, 0.028) ms per
    action and per layer gave medians of (0, 0), below every reading's cost (2026-12-04). `update_ms`, an
    update's time beyond the profiled optimizer step, from the pipeline's STEP spans. With `updates`, a straight
    async run of it is traced and read too, and `update_ms` comes from it (async updates after every
    backward)."""
    model, args, workers, b, m, schedule, steps = CASES[0]
    py = sys.executable
    profile(model, args, b, workers if CONCURRENT else 1, tmp)
    run([py, "-m", "partitioner.cli", "profile.json", "--workers", str(workers), "--schedule", schedule,
         "--microbatches", str(m), "--straight", "-o", "straight.json"], tmp)
    layers = len(json.loads((tmp / "profile.json").read_text())["layers"])
    Plan(schedule, m, workers, [StagePlan((0, layers), workers, list(range(workers)))]).save(tmp / "replicas.json")
    plans = ["straight.json", "replicas.json"]
    if updates:
        run([py, "-m", "partitioner.cli", "profile.json", "--workers", str(workers), "--schedule", "async",
             "--microbatches", str(m), "--straight", "-o", "async.json"], tmp)
        plans.append("async.json")
    if contrast:
        c = tmp / "contrast"
        c.mkdir()
        profile(CONTRAST[0], CONTRAST[1], CONTRAST[2], workers if CONCURRENT else 1, c)
        run([py, "-m", "partitioner.cli", "profile.json", "--workers", str(workers), "--schedule", schedule,
             "--microbatches", str(m), "--straight", "-o", "straight.json"], c)
    readings: list[tuple[float, dict[str, float]]] = []  # (the traced straight run's step ms, its reading)
    for k in range(runs):
        stepped_ms = []
        for plan in plans:
            (tmp / f"trace-{plan}").unlink(missing_ok=True)  # a resumed trace appends: each run its own
            stepped_ms.append(train(model, args, workers, b, m, steps, plan, tmp, "--trace", f"trace-{plan}"))
        stepped = stepped_ms[0]  # plans[0]: the straight pipeline
        also = [x for plan in plans[1:] for x in ("--also", "profile.json", plan, f"trace-{plan}")]
        if contrast:
            (tmp / "contrast" / "trace.json").unlink(missing_ok=True)
            train(CONTRAST[0], CONTRAST[1], workers, CONTRAST[2], m, steps, "straight.json", tmp / "contrast",
                  "--trace", "trace.json")
            also += ["--also", "contrast/profile.json", "contrast/straight.json", "contrast/trace.json"]
        out = run([py, "-m", "partitioner.calibrate", "profile.json", "straight.json", "trace-straight.json", *also,
                   "-o", "calibrated.json"], tmp)
        print(f"# calibration {k + 1} ({model} {json.dumps(args)}, {schedule}, straight and data-parallel"
              f"{', and ' + CONTRAST[0] + ' ' + json.dumps(CONTRAST[1]) + ' straight' if contrast else ''}, traced; "
              f"the straight run stepped in {stepped:.2f} ms): {out.strip()}", flush=True)
        got = json.loads((tmp / "calibrated.json").read_text())
        readings.append((stepped, {key: got.get(key, 0.0) for key in CALIBRATED
                                   if key in got or key == "layer_ms"}))  # no layer_ms read: none
    chosen = pick_reading([ms for ms, _ in readings], PICK)
    found = readings[chosen][1]
    print(f"# calibrated (reading {chosen + 1}, the {PICK} straight run): {json.dumps(found)}", flush=True)
    return found


def pick_reading(stepped_ms: list[float], how: str) -> int:
    """Which calibration reading to keep whole, by its traced straight run's step time: the fastest run's, or
    the median run's (the lower middle of an even count)."""
    order = sorted(range(len(stepped_ms)), key=lambda i: stepped_ms[i])
    return order[0] if how == "fastest" else order[(len(order) - 1) // 2]


def global_batch(runtime: dict[str, float], g: int, sizes: list[int], runs: int) -> None:
    """The microbatch size as the planner's decision (`pipeflow-plan --global-batch G`): the gpt case profiled
    at every size in one pipeflow-profile run, each size planned at m = G / b from its part of that profile
    and trained, and the size `--global-batch` picked from the whole profile."""
    model, args, workers, _, _, schedule, steps = CASES[3]
    py = sys.executable
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        wait_idle()
        run([py, "-m", "partitioner.profiler", "--model", model, "--model-args", json.dumps(args),
             "--microbatch-sizes", ",".join(map(str, sizes)), "--device", "cpu", "--threads", "1", "--repeats",
             "10", "--timing", TIMING, "--rounds", str(ROUNDS),
             "--ranks-per-host", str(workers if CONCURRENT else 1), "-o", "profile.json"],
            tmp)
        whole = {**json.loads((tmp / "profile.json").read_text()), **runtime}
        (tmp / "all.json").write_text(json.dumps(whole))
        run([py, "-m", "partitioner.cli", "all.json", "--workers", str(workers), "--schedule", schedule,
             "--global-batch", str(g), "-o", "picked.json"], tmp)
        picked = json.loads((tmp / "picked.json").read_text())["planner"]["microbatch_size"]
        parts = [{k: v for k, v in whole.items() if k != "other_microbatch_sizes"},
                 *({**o, **runtime} for o in whole.get("other_microbatch_sizes", []))]
        rows = []
        for part in sorted(parts, key=lambda q: q["microbatch_size"]):
            b = part["microbatch_size"]
            (tmp / "one.json").write_text(json.dumps(part))
            run([py, "-m", "partitioner.cli", "one.json", "--workers", str(workers), "--schedule", schedule,
                 "--microbatches", str(g // b), "-o", f"b{b}.json"], tmp)
            plan = json.loads((tmp / f"b{b}.json").read_text())
            meas = train(model, args, workers, b, g // b, steps, f"b{b}.json", tmp, runs=runs)
            rows.append((b, "-".join(str(st["replicas"]) for st in plan["stages"]),
                         float(plan["predicted"]["step_ms"]), meas))
    best = min(meas for *_, meas in rows)
    print(f"\n{model} {json.dumps(args)}, {workers} workers, {schedule}, {g} samples per step; `--global-batch {g}` "
          f"picked b = {picked}")
    print("| b x m | replicas per stage | predicted ms | measured ms | error | measured / fastest |")
    print("|---|---|---:|---:|---:|---:|")
    for b, shape, pred, meas in rows:
        mark = " (picked)" if b == picked else ""
        print(f"| {b} x {g // b}{mark} | {shape} | {pred:.2f} | {meas:.2f} | {100 * (pred / meas - 1):+.0f}% | "
              f"{meas / best:.3f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=3, help="training runs per case; the fastest counts (default 3)")
    p.add_argument("--concurrent-profile", action="store_true",
                   help="profile with pipeflow-profile --ranks-per-host (the case's ranks): the contention of "
                        "ranks computing at once, applied as far as the plan's ranks do")
    p.add_argument("--global-batch", type=int, default=None, metavar="G",
                   help="instead of the cases: the gpt case at G samples per step, every microbatch size of "
                        "--sizes measured, and the one pipeflow-plan --global-batch picks")
    p.add_argument("--sizes", default="4,8,16,32", help="microbatch sizes for --global-batch (default 4,8,16,32)")
    p.add_argument("--timing", choices=("idle", "stage"), default="idle",
                   help="pipeflow-profile --timing for every profile (stage: each layer inside the chain)")
    p.add_argument("--schedule", default=None, help="every case under this schedule (async: the calibration also "
                                                    "traces an async run, for the time per update)")
    p.add_argument("--no-contrast", dest="contrast", action="store_false",
                   help="calibrate from the first case's model alone (before 2026-11-28), not also from CONTRAST, a "
                        "model of half the layers per stage that tells a cost per layer call from one per action")
    p.add_argument("--pick", choices=("fastest", "median"), default="fastest",
                   help="the calibration reading kept whole: the run whose traced straight pipeline stepped fastest "
                        "(default) or the median one")
    p.add_argument("--rounds", type=int, default=3,
                   help="pipeflow-profile --rounds for every profile: each layer timed in that many rounds, half a "
                        "second apart, its fastest kept (default 3; 1: one round, as before 2026-12-04)")
    p.add_argument("--trials", type=int, default=1,
                   help="the whole method (calibration, then every case profiled, planned and trained) this many "
                        "times, each case's median error printed after (the host's pace moves between runs)")
    a = p.parse_args()
    if a.trials < 1:
        p.error(f"--trials must be >= 1, found {a.trials}")
    global CONCURRENT, TIMING, PICK, ROUNDS
    CONCURRENT, TIMING, PICK, ROUNDS = a.concurrent_profile, a.timing, a.pick, a.rounds
    errors: dict[int, list[tuple[float, float]]] = {}  # case -> (profile only, calibrated) error, per trial
    for trial in range(a.trials):
        if a.trials > 1:
            print(f"\n# trial {trial + 1} of {a.trials}", flush=True)
        print(f"# load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        with tempfile.TemporaryDirectory() as d:
            runtime = calibration(Path(d), a.runs, updates=a.schedule == "async", contrast=a.contrast)
        if a.global_batch is not None:
            global_batch(runtime, a.global_batch, [int(x) for x in a.sizes.split(",")], a.runs)
            continue
        for k, err in enumerate(cases(a, runtime)):
            errors.setdefault(k, []).append(err)
        print(f"# load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if a.trials > 1 and errors:
        print(f"\n# each case's median error over the {a.trials} trials (calibration, profile, plan and training "
              "anew in each)")
        print("| case | errors, calibrated | median, calibrated | median, profile only |")
        print("|---|---|---:|---:|")
        for k, errs in errors.items():
            model, args, _, b, m, schedule, _ = CASES[k]
            each = ", ".join(f"{100 * c:+.0f}%" for _, c in errs)
            print(f"| {model} {json.dumps(args)} {a.schedule or schedule} {b} x {m} | {each} | "
                  f"{100 * statistics.median(c for _, c in errs):+.1f}% | "
                  f"{100 * statistics.median(o for o, _ in errs):+.1f}% |", flush=True)


def cases(a: argparse.Namespace, runtime: dict[str, float]) -> Iterator[tuple[float, float]]:
    """Each case profiled, planned twice and trained: its table row printed, its (profile only, calibrated)
    error yielded."""
    print("| model | workers | schedule | b x m | replicas per stage | predicted ms, profile only | predicted ms, "
          "calibrated | measured ms | error, profile only | error, calibrated |")
    print("|---|---:|---|---|---|---:|---:|---:|---:|---:|")
    for model, args, workers, b, m, schedule, steps in CASES[:1] if a.quick else CASES:
        schedule = a.schedule or schedule
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            plain, calibrated = profile_and_plan(model, args, workers, b, m, schedule, tmp, runtime)
            meas = train(model, args, workers, b, m, steps, "calibrated.json", tmp, runs=a.runs)
        shape, was = ("-".join(str(st["replicas"]) for st in pl["stages"]) for pl in (calibrated, plain))
        shape += "" if was == shape else f" (profile only: {was})"
        old, new = float(plain["predicted"]["step_ms"]), float(calibrated["predicted"]["step_ms"])
        print(f"| {model} {json.dumps(args)} | {workers} | {schedule} | {b} x {m} | {shape} | {old:.2f} | {new:.2f} | "
              f"{meas:.2f} | {100 * (old / meas - 1):+.0f}% | {100 * (new / meas - 1):+.0f}% |", flush=True)
        yield old / meas - 1, new / meas - 1


if __name__ == "__main__":
    main()
