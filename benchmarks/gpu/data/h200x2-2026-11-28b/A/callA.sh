#!/bin/bash
# A (2026-11-28, second session): the capture at the start of the second step's actions (45a2311, e5d2365) on GPUs:
# tests/test_graphs.py (incl. the dict message with an unused output), eager against graphed weights on 2 GPUs
# (callZ's three runs), and the device memory in use at 1f1b 2 x 32 on 14,12, eager beside graphed
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S; git log --oneline | head -1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py -rs 2>&1 | tail -4
date -u +%H:%M:%S
bash .dev/callZ.sh 2>&1 | grep -v "^NVIDIA\|^[0-9][0-9]:"
date -u +%H:%M:%S
mkdir -p /tmp/bw
timeout 330 python3 benchmarks/gpu/bench.py --gpus 2 --steps 10 --timeout 150 --work /tmp/bw --out $OUT/res.md --rows "pf 1f1b 2 32 14,12 card=79.1; pf 1f1b 2 32 14,12 graphs card=79.1" 2>&1 | grep -E "RESULT|Error|error|Traceback|in use"
date -u +%H:%M:%S
mkdir -p $OUT/bw; find /tmp/bw -name "*.log" -size -2M -exec cp {} $OUT/bw/ \; 2>/dev/null
