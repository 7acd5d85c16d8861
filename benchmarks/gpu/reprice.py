"""Price measured GPU rows again on CPU: each row's plan on the profiles of its call, timed both ways, and on the
kernels profile with the runtime costs calibrated from one traced row (issue 13's accuracy, offline).

    python benchmarks/gpu/reprice.py benchmarks/gpu/data/h100x2-2026-11-26

The folder holds what bench.py wrote in those calls: idle-MB.json and kernels-MB.json (pipeflow-profile at
microbatch MB, --timing idle and kernels), the rows' plan files, calibration.json (what partitioner.calibrate
read from the traced row) and rows.json (each row's plan, microbatch size and measured step time). Prints the
markdown table of benchmarks/gpu/README.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from partitioner.calibrate import with_costs  # noqa: E402
from partitioner.plan import Plan  # noqa: E402
from partitioner.profile import Profile  # noqa: E402
from partitioner.service import evaluate_plan  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    a = p.parse_args(argv)
    meta = json.loads((a.folder / "rows.json").read_text())
    cal = json.loads((a.folder / "calibration.json").read_text())
    topo = meta["topology"]
    print(f"{meta['machine']}; {meta['model']}. Predicted step time (ms, and against the measured one):\n")
    print("| row | measured ms | idle profile | kernels profile | kernels + calibration |")
    print("|---|---:|---:|---:|---:|")
    for row in meta["rows"]:
        plan = Plan.load(str(a.folder / row["plan"]))
        cells = []
        idle, kernels = (
            Profile.load(str(a.folder / f"{kind}-{row['microbatch']}.json"))
            for kind in ("idle", "kernels"))
        for prof in (idle, kernels, with_costs(kernels, cal)):
            ms = float(evaluate_plan(prof, plan, topology=topo, optimizer="adam").plan.predicted["step_ms"])
            cells.append(f"{ms:.1f} ({(ms / row['measured_ms'] - 1) * 100:+.1f}%)")
        print(f"| {row['row']} | {row['measured_ms']:.1f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
