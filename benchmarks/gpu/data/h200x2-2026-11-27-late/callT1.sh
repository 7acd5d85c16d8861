#!/bin/bash
# T1: receive-buffer reuse on GPUs after bufpool.shared (copy engines and NCCL), then the issue-15 rows at 8 x 8
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; date -u +%H:%M:%S
for p2p in ce nccl; do
  PIPEFLOW_P2P=$p2p timeout 60 mpirun -np 2 python3 .dev/countpool.py --model gpt --model-args '{"layers":4,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}' --device cuda --dtype bfloat16 --steps 6 --microbatches 8 --microbatch-size 2 --layers-per-stage even --schedule 1f1b 2>&1 | grep -E 'POOL|rror' | tr '\n' ' '; echo " p2p=$p2p"
done
BT=540 bash .dev/call.sh "single 8; ddp 8; torch 1F1B 8; torch 1F1B 4; pf 1f1b 8 8 plan; pf 2bw 8 8 plan; pf 1f1b 8 8 spot; pf async 8 8 plan" 120
mv $OUT/bench-out.txt $OUT/bench-out-t1.txt; cp $OUT/results.md $OUT/results-t1.md
cd $OUT && tar czf work-t1.tgz work && rm -rf work
date -u +%H:%M:%S
