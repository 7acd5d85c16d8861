#!/bin/bash
# N: the profile timed as a graph replays the chain (--timing graphs, the default under PIPEFLOW_CUDA_GRAPHS=1):
# the GPU tests, then 1f1b on 14,12 at 2 x 32 eager and graphed and at 8 x 8 graphed, and the planner's plan at
# 2 x 32 graphed, each priced on its own profile
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py 2>&1 | tail -3
mkdir -p /tmp/bw
timeout 330 python3 benchmarks/gpu/bench.py --gpus 2 --steps 10 --timeout 150 --work /tmp/bw --out $OUT/res.md --rows "pf 1f1b 2 32 14,12 graphs; pf 1f1b 2 32 14,12; pf 1f1b 2 32 plan graphs; pf 1f1b 8 8 14,12 graphs" 2>&1 | grep -E "RESULT|Error|error|Traceback"
date -u +%H:%M:%S
mkdir -p $OUT/bw; find /tmp/bw -name "pf-*.log" -size -2M -exec cp {} $OUT/bw/ \; 2>/dev/null
python3 - <<'P'
import json, glob
for f in sorted(glob.glob("/tmp/bw/profile-*.json")):
    d = json.load(open(f)); L = d["layers"]
    print(f.split("/")[-1], d.get("timing"), "fwd", round(sum(l["forward_ms"] for l in L), 2), "bwd", round(sum(l["backward_ms"] for l in L), 2))
P
