#!/bin/bash
# T4: the planner at microbatch 2 on the same machine, from T3's profile
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; date -u +%H:%M:%S
BT=150 bash .dev/call.sh "pf 1f1b 2 32 plan" 140
grep -h 'profiled\|warning' /tmp/bw/profile-*.log
mv $OUT/bench-out.txt $OUT/bench-out-t4.txt; cd $OUT && tar czf work-t4.tgz work && rm -rf work
date -u +%H:%M:%S
