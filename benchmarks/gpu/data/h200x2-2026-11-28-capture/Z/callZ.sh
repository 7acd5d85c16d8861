#!/bin/bash
# Z: eager against graphed weights on 2 GPUs with the capture at the end of the first STEP (939a5da): 1f1b with
# the embedding and head tied across the stages, data parallelism, gpipe (as M)
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
D=/tmp/gq; rm -rf $D; mkdir -p $D
MA='{"layers":4,"d_model":256,"heads":4,"seq_len":128,"vocab":1000,"tie":true}'
python3 - <<'P'
from pipeflow.spec import build_model
from tests.conftest import write_plan
n = len(build_model("gpt", {"layers":4,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}).layers)
write_plan(__import__("pathlib").Path("/tmp/gq/dp.json"), "1f1b", 8, [(n, 2)])
P
A=(--model gpt --device cuda --dtype float32 --optimizer adam --lr 1e-3 --steps 6 --microbatch-size 2 --timeout 60 --log-every 1)
run() { name=$1; shift; for g in 0 1; do
  PIPEFLOW_CUDA_GRAPHS=$g timeout 60 mpirun -np 2 python3 -m pipeflow.train "${A[@]}" "$@" --save $D/$name-$g.pt > $D/$name-$g.log 2>&1; echo "$name graphs=$g rc=$?"
  grep -E "step [0-9]/6|rror" $D/$name-$g.log | grep -v "^\[rank 1\]" | sed 's/.*step/step/' | cut -c1-22 | tr '\n' ' '; echo
done; }
run tied --model-args "$MA" --schedule 1f1b --layers-per-stage even --microbatches 4
run dp --model-args "${MA/,\"tie\":true/}" --plan $D/dp.json
run gpipe --model-args "${MA/,\"tie\":true/}" --schedule gpipe --layers-per-stage even --microbatches 4
cp $D/*.log $OUT/ 2>/dev/null
python3 - <<'P'
import torch
L = lambda n: torch.load(f"/tmp/gq/{n}.pt", map_location="cpu", weights_only=True)
for s in ("tied", "dp", "gpipe"):
    try:
        a, b = L(f"{s}-0"), L(f"{s}-1")
        print(s, "max |eager - graphed|", max((a[k].float() - b[k].float()).abs().max().item() for k in a))
    except Exception as e:
        print(s, "compare failed", e)
P
date -u +%H:%M:%S
date -u +%H:%M:%S
