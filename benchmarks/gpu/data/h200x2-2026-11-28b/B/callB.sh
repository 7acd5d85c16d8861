#!/bin/bash
# B (2026-11-28, second session): issue 15's rows at this stop's code, one machine, one call (a regression check of
# the eager path after the capture hook, and graphs at microbatch 2 beside them)
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u +%H:%M:%S; git log --oneline | head -1
BT=570 bash .dev/call.sh "single 8; ddp 8; torch 1F1B 8; pf 1f1b 8 8 plan; pf 2bw 8 8 plan; pf async 8 8 14,12; pf 1f1b 2 32 14,12 graphs" 150
date -u +%H:%M:%S
