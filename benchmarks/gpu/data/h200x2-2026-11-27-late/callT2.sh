#!/bin/bash
# T2 (same machine, after T1): microbatch 4 and 2 rows, the planner's microbatch size
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; date -u +%H:%M:%S
BT=555 bash .dev/call.sh "pf 1f1b 4 16 plan mem=13.7; pf async 4 16 14,12; pf 1f1b 2 32 14,12; pf async 2 32 14,12; pf async 8 8 14,12; gb 1f1b 2,4,8" 150
mv $OUT/bench-out.txt $OUT/bench-out-t2.txt; cp $OUT/results.md $OUT/results-t2.md
cd $OUT && tar czf work-t2.tgz work && rm -rf work
date -u +%H:%M:%S
