#!/bin/bash
# a fresh 2 x H200: microbatch-2 profile first, with 5 rounds; planned rows
source .dev/device-env.sh >/dev/null 2>&1; export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
echo "uptime $(cut -d' ' -f1 /proc/uptime)"
BT=400 bash .dev/call.sh "pf 1f1b 2 32 14,12; pf 1f1b 2 32 plan; pf 1f1b 8 8 14,12; pf 1f1b 8 8 plan" 110
cd $OUT && tar czf work.tgz work && rm -rf work
