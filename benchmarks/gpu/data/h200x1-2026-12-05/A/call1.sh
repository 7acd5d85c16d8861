#!/bin/bash
# 2026-12-05, one H200 (2-GPU kinds withheld): the suite on a GPU machine at HEAD, then one-rank rows:
# does the profile price an eager stage at microbatch 2 on one rank, where no peer and no second host thread exist?
source .dev/device-env.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S; git log --oneline | head -1
timeout 250 python3 -m pytest -q -p no:cacheprovider tests -rs 2>&1 | tail -25 || true
date -u +%H:%M:%S
mkdir -p /tmp/bw
timeout 320 python3 benchmarks/gpu/bench.py --gpus 1 --steps 12 --timeout 150 --work /tmp/bw --out $OUT/res.md \
  --rows "single 2; pf 1f1b 2 32 26; pf 1f1b 2 32 26 graphs; single 8; pf 1f1b 8 8 26" 2>&1 | grep -E "RESULT|Error|error|Traceback"
date -u +%H:%M:%S
mkdir -p $OUT/bw; find /tmp/bw -name "*.log" -size -2M -exec cp {} $OUT/bw/ \; 2>/dev/null
cd $OUT/bw && tar czf ../bw.tgz . && cd .. && rm -rf bw
