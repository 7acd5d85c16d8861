#!/bin/bash
source .dev/device-env.sh >/dev/null 2>&1; export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
timeout 150 bash .dev/clipgpu.sh 2>&1 | grep -v '^WARNING' | tee $OUT/clipgpu.txt
BT=330 bash .dev/call.sh "pf 1f1b 8 8 14,12; pf 1f1b 8 8 14,12 clip=1.0; pf 2bw 8 8 14,12; pf 2bw 8 8 14,12 clip=1.0" 100
cd $OUT && tar czf work.tgz work && rm -rf work; cp /tmp/clip/*.log $OUT/ 2>/dev/null
