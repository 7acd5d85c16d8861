#!/bin/bash
# D (2026-11-28, third session): the sharded exchange landing layer by layer under the next forward. First the
# weights on NCCL, sharded against unsharded (bit for bit), then issue 15's 2bw and 1f1b rows sharded and not.
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S; git log --oneline | head -1
D=/tmp/sq; rm -rf $D; mkdir -p $D
python3 - <<'P'
from pipeflow.spec import build_model
from tests.conftest import write_plan
n = len(build_model("gpt", {"layers":4,"d_model":1024,"heads":8,"seq_len":128,"vocab":1000}).layers)
write_plan(__import__("pathlib").Path("/tmp/sq/dp.json"), "1f1b", 8, [(n, 2)])
P
MA='{"layers":4,"d_model":1024,"heads":8,"seq_len":128,"vocab":1000,"tie":true}'
A=(--model gpt --model-args "$MA" --device cuda --dtype float32 --optimizer adam --lr 1e-3 --steps 6 --microbatch-size 2 --timeout 60 --log-every 2 --plan $D/dp.json --eval-every 3)
for s in 1f1b 2bw gpipe; do for sh in no yes; do
  timeout 90 mpirun -np 2 python3 -m pipeflow.train "${A[@]}" --schedule $s $([ $sh = yes ] && echo --shard-optimizer) --checkpoint-every 3 --checkpoint-dir $D/ck-$s-$sh --save $D/$s-$sh.pt > $D/$s-$sh.log 2>&1
  echo "$s shard=$sh rc $?"; grep -E "step 6/6|eval|land layer|rror" $D/$s-$sh.log | grep -v "^\[rank 1\]" | cut -c1-150
done; done
python3 - <<'P'
import torch
L = lambda n: torch.load(f"/tmp/sq/{n}.pt", map_location="cpu", weights_only=True)
for s in ("1f1b", "2bw", "gpipe"):
    try:
        a, b = L(f"{s}-no"), L(f"{s}-yes")
        print(s, "sharded == unsharded bitwise:", all(torch.equal(a[k], b[k]) for k in a), len(a), "tensors")
        c = torch.load(f"/tmp/sq/ck-{s}-yes/step-000003/stage-000.pt", map_location="cpu", weights_only=True)["weights"]
        d = torch.load(f"/tmp/sq/ck-{s}-no/step-000003/stage-000.pt", map_location="cpu", weights_only=True)["weights"]
        print(s, "checkpoint at step 3 equal:", all(torch.equal(c[k], d[k]) for k in c))
    except Exception as e:
        print(s, "compare failed", e)
P
cp $D/*.log $OUT/ 2>/dev/null
date -u +%H:%M:%S
BT=${BT:-430} bash .dev/call.sh "${ROWS:-single 8; ddp 8; pf 2bw 8 8 plan; pf 2bw 8 8 plan shard; pf 1f1b 8 8 plan shard; pf 1f1b 8 8 plan}" 120
date -u +%H:%M:%S
