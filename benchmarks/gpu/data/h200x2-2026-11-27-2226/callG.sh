#!/bin/bash
# G: this stop on GPUs (Control's quiet waits, World.mpi a Control, shared-memory check, loss check): evaluation/lr runs
# agreed: evaluation/lr runs against one GPU (copy engines, NCCL, gpipe, data parallel, 2bw, async), then 1f1b 8 x 8
# on 14,12 with this commit and with deb86ab (.dev/old), alternated, on one machine
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
timeout 200 bash .dev/evallr.sh > $OUT/evallr-g.txt 2>&1; echo "evallr rc=$?"
grep -E "vs one|evals|rc=" $OUT/evallr-g.txt | head -20
mkdir -p /tmp/bw
for who in new old new; do
  if [ $who = new ]; then R=$PWD; else R=$PWD/.dev/old; fi
  (cd $R && PYTHONPATH=$R:/tmp/site timeout 150 python3 benchmarks/gpu/bench.py --gpus 2 --steps 10 --timeout 180 --work /tmp/bw --rows "pf 1f1b 8 8 14,12" --out $OUT/res-$who.md 2>&1 | grep -E "RESULT|Error|error" | sed "s/^/$who /")
done
date -u +%H:%M:%S
