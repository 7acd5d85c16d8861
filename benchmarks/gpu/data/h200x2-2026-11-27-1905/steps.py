"""Per rank, per step: period and span sums from a pipeflow trace (the device call's own reading)."""
import json, sys
from partitioner.calibrate import _spans
for path in sys.argv[1:]:
    print("##", path)
    for rank, steps in sorted(_spans(json.load(open(path))).items()):
        starts = {st: sp[0][1] for st, sp in steps.items() if sp}
        for st in sorted(steps):
            if st + 1 not in starts:
                continue
            tot = {}
            for kind, a, b in steps[st]:
                k = kind if kind in ("F", "B", "W", "STEP") else kind.split("_")[0]
                tot[k] = tot.get(k, 0.0) + (b - a)
            per = starts[st + 1] - starts[st]
            print(f"rank {rank} step {st}: period {per:.1f} " + " ".join(f"{k} {v:.1f}" for k, v in sorted(tot.items()))
                  + f" idle {per - sum(tot.values()):.1f}")
