"""Convergence of 1f1b, async (PipeDream weight stashing) and 2bw on the built-in gpt, 4 CPU ranks.

    python benchmarks/convergence/run.py                 # ~8 minutes on 2 cores; writes results.json
    python benchmarks/convergence/run.py --steps 10      # a quick look

Every schedule trains on the same samples (steps x m x b) with the same optimizer; the loss curve
of each run is read from its log (and written to TensorBoard under OUT/tb/<schedule>), and each
stage's `stash peak` line is compared with the versions the delayed-update formula needs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
MODEL = {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 32, "vocab": 256}
LOSS = re.compile(r"step (\d+)/\d+\s+loss ([\d.]+|nan|inf)")
STASH = re.compile(r"\[rank (\d+)\] INFO pipeflow\.stash: stash peak: (\d+) bytes, (\d+) versions "
                   r"\(stage parameters (\d+) bytes\)")


def predicted_versions(schedule: str, stages: int, j: int) -> tuple[int, int]:
    """(distinct versions in flight, copies apart from the live weights) at stage j = 1..n.

    async: microbatches t-n+j .. t are in flight on versions t-2(n-j) .. t-n+j: n-j+1 versions; on the
    last stage the one in flight is the live one (F and B with no update between): no copy.
    2bw: versions k-1 and k (PipeDream-2BW's double buffer); the live weights are written in place by
    the optimizer, so both are copies on stages whose microbatches cross an update, 1 on the last."""
    if schedule == "async":
        return stages - j + 1, (stages - j + 1 if j < stages else 0)
    return 2, (2 if j < stages else 1)


def run(schedule: str, args: argparse.Namespace, out: Path) -> dict:
    mpirun = os.environ.get("PIPEFLOW_MPIRUN") or str(BIN / "mpirun")
    cmd = [mpirun, "-np", "4", sys.executable, "-m", "pipeflow.train", "--model", "gpt",
           "--model-args", json.dumps(MODEL), "--layers-per-stage", "1,1,1,1", "--schedule", schedule,
           "--steps", str(args.steps), "--microbatches", str(args.microbatches),
           "--microbatch-size", str(args.microbatch_size), "--optimizer", "adam", "--lr", str(args.lr),
           "--device", "cpu", "--log-every", str(args.log_every), "--tensorboard", str(out / "tb" / schedule)]
    env = dict(os.environ, PIPEFLOW_LOG="INFO", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    curve = [(int(s), float(v)) for s, v in LOSS.findall(proc.stderr)]
    stash = {}
    for rank, nbytes, versions, pbytes in STASH.findall(proc.stderr):
        j = int(rank) + 1  # one rank per stage here
        pv, pc = predicted_versions(schedule, 4, j)
        stash[j] = {"peak_bytes": int(nbytes), "versions": int(versions), "param_bytes": int(pbytes),
                    "formula_versions": pv, "predicted_copies": pc, "predicted_bytes": pc * int(pbytes)}
    samples = args.steps * args.microbatches * args.microbatch_size
    return {"schedule": schedule, "curve": curve, "final_loss": curve[-1][1], "wall_s": round(wall, 1),
            "samples": samples, "stash": dict(sorted(stash.items()))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=6)
    p.add_argument("--out", type=Path, default=HERE / "out")
    p.add_argument("--schedules", default="1f1b,async,2bw")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for s in args.schedules.split(","):
        r = run(s, args, args.out)
        print(f"{s:6s} final loss {r['final_loss']:.4f}  ({r['wall_s']:.0f} s)", flush=True)
        results.append(r)
    base = next((r["final_loss"] for r in results if r["schedule"] == "1f1b"), None)
    lines = ["| schedule | final loss | vs 1f1b | within 5% | wall (s) |", "|---|---|---|---|---|"]
    for r in results:
        rel = "" if base is None else f"{(r['final_loss'] - base) / base:+.1%}"
        ok = "" if base is None else ("yes" if abs(r["final_loss"] - base) <= 0.05 * base else "no")
        lines.append(f"| {r['schedule']} | {r['final_loss']:.4f} | {rel} | {ok} | {r['wall_s']:.0f} |")
    lines += ["", "| schedule | stage | parameters (B) | formula versions | predicted copies (B) | measured peak (B) "
              "| measured versions |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for j, st in r["stash"].items():
            lines.append(f"| {r['schedule']} | {j} | {st['param_bytes']} | {st['formula_versions']} | "
                         f"{st['predicted_copies']} ({st['predicted_bytes']}) | {st['peak_bytes']} | "
                         f"{st['versions']} |")
    table = "\n".join(lines)
    print(table)
    meta = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, CPU only",
            "python": platform.python_version(), "args": {k: str(v) for k, v in vars(args).items()},
            "model_args": MODEL}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (args.out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
