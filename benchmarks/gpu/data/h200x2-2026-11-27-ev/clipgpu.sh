#!/bin/bash
# --clip-grad-norm on GPUs: pipelines and data parallelism against one GPU, 2bw runs; no hang
set -u
D=/tmp/clip; mkdir -p $D
A=(--model gpt --model-args '{"layers":4,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}' --device cuda --dtype float32 --optimizer adam --lr 1e-3 --steps 5 --microbatches 4 --microbatch-size 2 --timeout 60)
python3 - <<'P'
from pipeflow.spec import build_model
from tests.conftest import write_plan
n = len(build_model("gpt", {"layers":4,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}).layers)
write_plan(__import__("pathlib").Path("/tmp/clip/dp.json"), "1f1b", 4, [(n, 2)])
write_plan(__import__("pathlib").Path("/tmp/clip/dp2bw.json"), "2bw", 4, [(n, 2)])
P
run() { name=$1; np=$2; shift 2; timeout 90 mpirun -np $np python3 -m pipeflow.train "${A[@]}" "$@" --save $D/$name.pt > $D/$name.log 2>&1; echo "$name rc=$?"; grep -E 'clipped|error' $D/$name.log | head -3; }
run one 1 --clip-grad-norm 0.05
run one-noclip 1
run pp 2 --schedule 1f1b --layers-per-stage even --clip-grad-norm 0.05
run dp 2 --plan $D/dp.json --clip-grad-norm 0.05
run dpshard 2 --plan $D/dp.json --shard-optimizer --clip-grad-norm 0.05
run bw 2 --schedule 2bw --layers-per-stage even --clip-grad-norm 0.05
run bw-noclip 2 --schedule 2bw --layers-per-stage even
run bwdp 2 --plan $D/dp2bw.json --clip-grad-norm 0.05
python3 - <<'P'
import torch
L = lambda n: torch.load(f"/tmp/clip/{n}.pt", map_location="cpu", weights_only=True)
def diff(a, b):
    a, b = L(a), L(b); return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
for other in ("pp", "dp", "dpshard"):
    print(f"{other} vs one (clipped): max |diff| {diff(other, 'one'):.3e}")
print(f"one clipped vs not: {diff('one', 'one-noclip'):.3e}")
print(f"2bw clipped vs not: {diff('bw', 'bw-noclip'):.3e}; 2bw dp clipped vs 2bw pipeline clipped: {diff('bwdp', 'bw'):.3e}")
P
