#!/bin/bash
# L4 (2026-11-28, third session): the review mends (5fe8f36) on NCCL: sharded against unsharded weights (12 x 256,
# 1f1b and 2bw), then the 2bw rows sharded and not, and one GPU.
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
D=/tmp/sq; rm -rf $D; mkdir -p $D
SM='{"layers":12,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}'
python3 - <<'P'
from pipeflow.spec import build_model
from tests.conftest import write_plan
args = {"layers":12,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}
write_plan(__import__("pathlib").Path("/tmp/sq/sm.json"), "1f1b", 8, [(len(build_model("gpt", args).layers), 2)])
P
for s in 1f1b 2bw; do for sh in no yes; do
  timeout 90 mpirun -np 2 python3 -m pipeflow.train --model gpt --model-args "$SM" --device cuda --dtype float32 --optimizer adam --lr 1e-3 --steps 6 --microbatch-size 2 --timeout 60 --log-every 6 --plan $D/sm.json --schedule $s $([ $sh = yes ] && echo --shard-optimizer) --save $D/$s-$sh.pt > $D/$s-$sh.log 2>&1
  echo "$s shard=$sh rc $? $(grep -E 'step 6/6|chunk' $D/$s-$sh.log | grep -v '^\[rank 1\]' | sed 's/.*INFO //' | cut -c1-100 | tr '\n' ' ')"
done; done
python3 - <<'P'
import torch
for s in ("1f1b", "2bw"):
    a, b = (torch.load(f"/tmp/sq/{s}-{n}.pt", map_location="cpu", weights_only=True) for n in ("no", "yes"))
    print(s, "sharded == unsharded bitwise:", all(torch.equal(a[k], b[k]) for k in a), len(a), "tensors")
P
cp $D/*.log $OUT/ 2>/dev/null
date -u +%H:%M:%S
BT=${BT:-300} bash .dev/call.sh "${ROWS:-single 8; pf 2bw 8 8 plan shard; pf 2bw 8 8 plan; pf 2bw 8 8 plan shard}" 120
date -u +%H:%M:%S
