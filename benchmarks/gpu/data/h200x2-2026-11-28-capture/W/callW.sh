#!/bin/bash
# W: the planner's pick among graphed microbatch sizes (gb ... graphs), the planner's plan at 2 x 32 graphed, and the
# graphed 2 x 32 row under card.py again (its watcher now joined before exit: V's exit 6 after the result)
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
mkdir -p /tmp/bw
timeout 530 python3 benchmarks/gpu/bench.py --gpus 2 --steps 10 --timeout 150 --work /tmp/bw --out $OUT/res.md --rows "pf 1f1b 2 32 14,12 graphs card=79.1; gb 1f1b 2,4,8 graphs; pf 1f1b 2 32 plan graphs" 2>&1 | grep -E "RESULT|Error|error|Traceback|CARD|picked|gb"
date -u +%H:%M:%S
mkdir -p $OUT/bw; find /tmp/bw -name "*.log" -size -2M -exec cp {} $OUT/bw/ \; 2>/dev/null; cp /tmp/bw/plan*.json $OUT/bw/ 2>/dev/null
