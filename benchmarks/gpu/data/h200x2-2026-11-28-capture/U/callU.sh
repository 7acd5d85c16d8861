#!/bin/bash
# V: the warm-up's cache released too: device memory in use graphed at 2 x 32 and 8 x 8 (eager in U)
# graphed, each rank held to an 80 GB card's 79.1 GiB), the GPU tests (review mends, left_out, end_step), 8 x 8 graphed
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S; git log --oneline | head -1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py 2>&1 | tail -3
mkdir -p /tmp/bw
timeout 420 python3 benchmarks/gpu/bench.py --gpus 2 --steps 10 --timeout 150 --work /tmp/bw --out $OUT/res.md --rows "pf 1f1b 2 32 14,12 card=79.1; pf 1f1b 2 32 14,12 graphs card=79.1; pf 1f1b 8 8 14,12 card=79.1; pf 1f1b 8 8 14,12 graphs card=79.1" 2>&1 | grep -E "RESULT|Error|error|Traceback|in use"
date -u +%H:%M:%S
cp $OUT/res.md /dev/stdout 2>/dev/null | head -20
mkdir -p $OUT/bw; find /tmp/bw -name "pf-*.log" -size -2M -exec cp {} $OUT/bw/ \; 2>/dev/null
