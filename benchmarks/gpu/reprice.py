"""Price measured GPU rows again on CPU: each row's plan on the profiles of its call, and with the runtime costs
calibrated from that call's traced rows (issue 13's accuracy, offline).

    python benchmarks/gpu/reprice.py benchmarks/gpu/data/h100x2-2026-11-26
    python benchmarks/gpu/reprice.py benchmarks/gpu/data/h200x2-2026-11-26

A folder holds what bench.py wrote in those calls and rows.json (each row's plan, profile and measured step
time). Two layouts:
- idle-MB.json and kernels-MB.json (pipeflow-profile at microbatch MB, --timing idle and kernels) and
  calibration.json (what partitioner.calibrate read from one traced row): columns idle, kernels, kernels +
  calibration;
- rows naming their profile, and `calibrations` in rows.json: named lists of traced runs (profile, plan,
  trace; a trace may be gzipped) that partitioner.calibrate reads together: a column per calibration.
Prints the markdown table of benchmarks/gpu/README.md; with `memory_rows` in rows.json (plan, profile and the
peak GiB per rank measured), the predicted peaks against them too.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from partitioner.calibrate import calibrate  # noqa: E402
from partitioner.plan import Plan  # noqa: E402
from partitioner.profile import Profile  # noqa: E402
from partitioner.service import evaluate_plan  # noqa: E402


def _trace(path: Path) -> Any:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    a = p.parse_args(argv)
    meta = json.loads((a.folder / "rows.json").read_text())
    topo = meta["topology"]

    def cell(prof: Profile, plan: Plan, measured: float) -> str:
        ms = float(evaluate_plan(prof, plan, topology=topo, optimizer="adam").plan.predicted["step_ms"])
        return f"{ms:.1f} ({(ms / measured - 1) * 100:+.1f}%)"

    print(f"{meta['machine']}; {meta['model']}. Predicted step time (ms, and against the measured one):\n")
    if "calibrations" not in meta:
        cal = json.loads((a.folder / "calibration.json").read_text())
        print("| row | measured ms | idle profile | kernels profile | kernels + calibration |")
        print("|---|---:|---:|---:|---:|")
        for row in meta["rows"]:
            plan = Plan.load(str(a.folder / row["plan"]))
            idle, kernels = (Profile.load(str(a.folder / f"{kind}-{row['microbatch']}.json"))
                             for kind in ("idle", "kernels"))
            cells = [cell(prof, plan, row["measured_ms"]) for prof in (idle, kernels, kernels.with_costs(cal))]
            print(f"| {row['row']} | {row['measured_ms']:.1f} | " + " | ".join(cells) + " |")
        return 0
    found = {}
    for name, runs in meta["calibrations"].items():
        loaded = [(Profile.load(str(a.folder / f)), Plan.load(str(a.folder / pl)), _trace(a.folder / t))
                  for f, pl, t in runs]
        found[name] = calibrate(*loaded[0], skip=int(meta.get("skip", 2)), also=loaded[1:])
        print(f"- calibration from the {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in found[name].items()))
    print("\n| row | measured ms | profile alone |" + "".join(f" + calibration ({n}) |" for n in found))
    print("|---|---:|---:|" + "---:|" * len(found))
    for row in meta["rows"]:
        plan, prof = Plan.load(str(a.folder / row["plan"])), Profile.load(str(a.folder / row["profile"]))
        cells = [cell(prof, plan, row["measured_ms"])]
        cells += [cell(prof.with_costs(costs), plan, row["measured_ms"]) for costs in found.values()]
        print(f"| {row['row']} | {row['measured_ms']:.1f} | " + " | ".join(cells) + " |")
    memory(a.folder, meta)
    return 0


def memory(folder: Path, meta: dict[str, Any]) -> None:
    """`memory_rows` in rows.json (plan, profile, measured peak GiB per rank): the plan's predicted peaks."""
    if not meta.get("memory_rows"):
        return
    print("\nPeak memory per rank (GiB), predicted against measured:\n")
    print("| row | measured | predicted |")
    print("|---|---|---|")
    for row in meta["memory_rows"]:
        plan, prof = Plan.load(str(folder / row["plan"])), Profile.load(str(folder / row["profile"]))
        peaks = evaluate_plan(prof, plan, topology=meta["topology"], optimizer="adam").plan.predicted
        got = " / ".join(f"{x / 2**30:.2f}" for x in peaks["peak_memory_bytes"])
        print(f"| {row['row']} | {' / '.join(f'{x:.2f}' for x in row['measured_gib'])} | {got} |")


if __name__ == "__main__":
    sys.exit(main())
