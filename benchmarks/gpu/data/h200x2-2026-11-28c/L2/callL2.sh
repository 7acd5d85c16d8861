#!/bin/bash
# L2 (2026-11-28, third session): sharded against unsharded weights on NCCL with a control (the unsharded run twice),
# on a GPT whose float32 runs were bit-reproducible before (12 x 256) and the 4 x 1024 tied one of L1; then 2bw's
# data-parallel rows sharded and not, traced.
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
D=/tmp/sq; rm -rf $D; mkdir -p $D
SM='{"layers":12,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}'
BG='{"layers":4,"d_model":1024,"heads":8,"seq_len":128,"vocab":1000,"tie":true}'
python3 - <<'P'
import json
from pipeflow.spec import build_model
from tests.conftest import write_plan
for name, args in (("sm", {"layers":12,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}),
                   ("bg", {"layers":4,"d_model":1024,"heads":8,"seq_len":128,"vocab":1000})):
    write_plan(__import__("pathlib").Path(f"/tmp/sq/{name}.json"), "1f1b", 8, [(len(build_model("gpt", args).layers), 2)])
P
one() { tag=$1; ma=$2; plan=$3; s=$4; shift 4
  timeout 90 mpirun -np 2 python3 -m pipeflow.train --model gpt --model-args "$ma" --device cuda --dtype float32 --optimizer adam --lr 1e-3 --steps 6 --microbatch-size 2 --timeout 60 --log-every 6 --plan $D/$plan.json --schedule $s "$@" --save $D/$tag.pt > $D/$tag.log 2>&1
  echo "$tag rc $? $(grep -E 'step 6/6|in [0-9]+ chunk' $D/$tag.log | grep -v '^\[rank 1\]' | sed 's/.*INFO //' | cut -c1-90 | tr '\n' ' ')"; }
for c in "sm $SM 1f1b" "sm $SM 2bw" "bg $BG 1f1b"; do set -- $c
  one $1-$3-no-a "$2" $1 $3; one $1-$3-no-b "$2" $1 $3; one $1-$3-yes "$2" $1 $3 --shard-optimizer
done
python3 - <<'P'
import torch
L = lambda n: torch.load(f"/tmp/sq/{n}.pt", map_location="cpu", weights_only=True)
d = lambda a, b: max((a[k].double() - b[k].double()).abs().max().item() for k in a)
for c in ("sm-1f1b", "sm-2bw", "bg-1f1b"):
    try:
        a, b, s = L(f"{c}-no-a"), L(f"{c}-no-b"), L(f"{c}-yes")
        print(c, "max |unsharded - unsharded again|", d(a, b), " max |unsharded - sharded|", d(a, s), len(a), "tensors")
    except Exception as e:
        print(c, "compare failed", e)
P
cp $D/*.log $OUT/ 2>/dev/null
date -u +%H:%M:%S
BT=${BT:-330} bash .dev/call.sh "${ROWS:-pf 2bw 8 8 plan shard trace; pf 2bw 8 8 plan trace}" 120
date -u +%H:%M:%S
