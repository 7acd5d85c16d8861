#!/bin/bash
# P1 (2026-11-28, fourth session): the replicas' NCCL group on a high-priority stream (PIPEFLOW_REDUCE_PRIORITY=high)
# against the default, 2bw's data parallelism traced and untraced, one GPU for the limit.
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u +%H:%M:%S
BT=${BT:-560} bash .dev/call.sh "${ROWS:-single 8; pf 2bw 8 8 plan trace; pf 2bw 8 8 plan trace env:PIPEFLOW_REDUCE_PRIORITY=high; pf 2bw 8 8 plan env:PIPEFLOW_REDUCE_PRIORITY=high; pf 2bw 8 8 plan}" 120
date -u +%H:%M:%S
