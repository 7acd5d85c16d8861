#!/bin/bash
# D3: --eval-every and the lr schedule on GPUs with the weights compared (evallr.sh, the S1 script given time)
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
timeout 400 bash .dev/evallr.sh > $OUT/evallr-d3.txt 2>&1; echo "evallr rc=$?"
grep -v "^\[rank\|^INFO\|^$" $OUT/evallr-d3.txt | tail -20
for n in one pp ppnccl gpipe dp bw as; do echo "$n: $(grep -ho 'eval loss [0-9.]*' /tmp/evlr/$n.log | tr '\n' ' ')"; done
mkdir -p $OUT/evlr && cp /tmp/evlr/*.log $OUT/evlr/ 2>/dev/null; cd $OUT && tar czf evlr-d3.tgz evlr && rm -rf evlr
date -u +%H:%M:%S
