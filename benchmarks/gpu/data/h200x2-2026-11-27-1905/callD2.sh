#!/bin/bash
# D2: host time per action beside device time: DP (26 x 2) and the 14,12 pipeline at microbatch 2; DP with
# autograd accumulation; torch's own loop and DDP at microbatch 2 for the host's pace
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8 PIPEFLOW_LOG=INFO
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; date -u +%H:%M:%S; cat /proc/loadavg
M='{"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000, "dataset": "synthetic"}'
run() { tag=$1; shift; echo "=== $tag $(date -u +%H:%M:%S)"
  HOSTTRACE=$OUT/h-$tag timeout 150 mpirun -np 2 python3 .dev/hostwrap.py --model gpt --model-args "$M" --device cuda \
   --dtype bfloat16 --optimizer adam --lr 1e-4 --steps 16 --log-every 4 --microbatch-size 2 --microbatches 32 \
   --schedule 1f1b --peak-tflops 989.0 --trace $OUT/t-$tag.json "$@" > $OUT/log-$tag.txt 2>&1
  grep -h "steady\|monitor: step" $OUT/log-$tag.txt | grep "rank 0" | tail -3
  python3 .dev/hostan.py $OUT/h-$tag $OUT/t-$tag.json; }
run dp --plan .dev/dp.json
run pp --plan .dev/pp.json
PIPEFLOW_GRAD_ACCUM=autograd run dpauto --plan .dev/dp.json
run dp2 --plan .dev/dp.json
BT=200 bash .dev/call.sh "single 2; ddp 2" 90
cd $OUT && tar czf d2.tgz h-* t-* log-* && rm -f h-* t-*
date -u +%H:%M:%S; cat /proc/loadavg
