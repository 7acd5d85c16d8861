#!/bin/bash
# X: the planner's pick among graphed microbatch sizes (W's gb row met bench.py's --timeout 150 while profiling)
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
mkdir -p /tmp/bw
timeout 560 python3 benchmarks/gpu/bench.py --gpus 2 --steps 10 --timeout 400 --work /tmp/bw --out $OUT/res.md --rows "gb 1f1b 2,4,8 graphs" 2>&1 | grep -E "RESULT|rror|Traceback|failed|picked"
date -u +%H:%M:%S
tail -5 /tmp/bw/profile-*.log
mkdir -p $OUT/bw; cp /tmp/bw/pf-*.log /tmp/bw/plan-*.log $OUT/bw/ 2>/dev/null
python3 - <<'P'
import json, glob
for f in sorted(glob.glob("/tmp/bw/profile-*.json")):
    d = json.load(open(f))
    for at in [d, *d.get("other_microbatch_sizes", [])]:
        L = at["layers"]
        print(f.split("/")[-1], d.get("timing"), "b", at["microbatch_size"], "fwd", round(sum(l["forward_ms"] for l in L), 2), "bwd", round(sum(l["backward_ms"] for l in L), 2))
P
