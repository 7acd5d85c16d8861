#!/bin/bash
# T3: the interleaved profile at microbatch 2 on a fresh 2 x H200, and the row it prices
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; date -u +%H:%M:%S
BT=200 bash .dev/call.sh "pf 1f1b 2 32 14,12" 190
grep -h 'profiled\|warning' /tmp/bw/profile-*.log
mv $OUT/bench-out.txt $OUT/bench-out-t3.txt; cd $OUT && tar czf work-t3.tgz work && rm -rf work
date -u +%H:%M:%S
