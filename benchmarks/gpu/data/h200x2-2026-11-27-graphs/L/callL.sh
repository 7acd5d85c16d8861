#!/bin/bash
# L: CUDA graphs: the GPU tests again, then 1f1b on 14,12 at 2 x 32, 4 x 16, 8 x 8, eager (stage-timed profile) and
# graphed (priced on a kernels-timed profile), side by side on one machine
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py 2>&1 | tail -4
mkdir -p /tmp/bw
G=env:PIPEFLOW_CUDA_GRAPHS=1
timeout 560 python3 benchmarks/gpu/bench.py --gpus 2 --steps 10 --timeout 180 --work /tmp/bw --out $OUT/res.md --rows "pf 1f1b 2 32 14,12; pf 1f1b 2 32 14,12 kernels $G; pf 1f1b 4 16 14,12; pf 1f1b 4 16 14,12 kernels $G; pf 1f1b 8 8 14,12; pf 1f1b 8 8 14,12 kernels $G; pf 1f1b 2 32 14,12 $G" 2>&1 | grep -E "RESULT|Error|error|Traceback"
date -u +%H:%M:%S
find /tmp/bw -name "*.log" -size -2M -exec cp {} $OUT/ \; 2>/dev/null
