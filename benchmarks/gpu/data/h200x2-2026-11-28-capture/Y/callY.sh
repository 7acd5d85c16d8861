#!/bin/bash
# Y (the same warm machine as X): the planner's 8 x 8 plan eager and graphed, beside X's gb pick
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u +%H:%M:%S
timeout 300 python3 benchmarks/gpu/bench.py --gpus 2 --steps 10 --timeout 140 --work /tmp/bw --out $OUT/res.md --rows "pf 1f1b 8 8 plan; pf 1f1b 8 8 plan graphs" 2>&1 | grep -E "RESULT|rror|Traceback|failed"
date -u +%H:%M:%S
