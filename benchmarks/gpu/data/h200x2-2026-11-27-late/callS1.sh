#!/bin/bash
# S1: --eval-every and the lr schedule on GPUs (evallr.sh); the 10.3 B GPT held to an 80 GB H100's 79.1 GiB per GPU
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
date -u +%H:%M:%S
timeout 150 bash .dev/evallr.sh > $OUT/evallr.txt 2>&1; echo "evallr rc=$?"
tail -12 $OUT/evallr.txt
mkdir -p $OUT/evlr && cp /tmp/evlr/*.log $OUT/evlr/ 2>/dev/null
date -u +%H:%M:%S
BT=380 bash .dev/call.sh "big 1f1b 1 64 plan mem=78 shard card=79.1" 360
mv $OUT/bench-out.txt $OUT/bench-out-big.txt; mv $OUT/work $OUT/work-big
cp $OUT/results.md $OUT/results-big.md 2>/dev/null
grep -h CARD /tmp/bw/pf-*card*.log | head
cd $OUT && tar czf work.tgz work* evlr && rm -rf work-big evlr
date -u +%H:%M:%S
