#!/bin/bash
# rows at microbatch 2 and 8 priced by profiles of 5 rounds; on H100 cards the 10.3 B model too
source .dev/device-env.sh >/dev/null 2>&1; export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "cards: $NAME x $(nvidia-smi -L | wc -l)"
BT=330 bash .dev/call.sh "single 8; pf 1f1b 2 32 14,12; pf 1f1b 8 8 14,12; pf 1f1b 4 16 14,12" 110
mv $OUT/bench-out.txt $OUT/bench-out-1.txt; mv $OUT/work $OUT/work1
if [[ "$NAME" == *H100* ]]; then
  BT=250 bash .dev/call.sh "big 1f1b 1 64 plan mem=78 shard" 240
  mv $OUT/bench-out.txt $OUT/bench-out-big.txt; mv $OUT/work $OUT/work-big
fi
cd $OUT && tar czf work.tgz work* && rm -rf work1 work-big
