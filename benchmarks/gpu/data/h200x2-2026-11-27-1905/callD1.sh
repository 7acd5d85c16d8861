#!/bin/bash
# D1: the data-parallel plan at microbatch 2 against the pipeline, traced, 20 steps, per-step periods
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; date -u +%H:%M:%S
nproc; cat /proc/loadavg
BT=500 bash .dev/call.sh "pf 1f1b 2 32 plan trace; pf 1f1b 2 32 14,12 trace; pf 1f1b 2 32 plan; pf 1f1b 2 32 14,12" 150 --steps 20
python3 .dev/steps.py /tmp/bw/trace-*.json > $OUT/steps-d1.txt 2>&1; tail -n 100 $OUT/steps-d1.txt | grep "rank 0" | head -50
grep -h 'profiled\|warning' /tmp/bw/profile-*.log
grep -h "monitor" /tmp/bw/pf-*.log | head -40
mv $OUT/bench-out.txt $OUT/bench-out-d1.txt; cp /tmp/bw/trace-*.json $OUT/work/ ; cd $OUT && tar czf work-d1.tgz work && rm -rf work
date -u +%H:%M:%S; cat /proc/loadavg
