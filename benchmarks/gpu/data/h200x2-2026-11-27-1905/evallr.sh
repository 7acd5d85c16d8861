#!/bin/bash
# --eval-every and the learning-rate schedule on GPUs: pipelines (copy engines and NCCL) and data parallelism
# against one GPU; 2bw and async with both; eval losses and final weights compared.
set -u
D=/tmp/evlr; rm -rf $D; mkdir -p $D
A=(--model gpt --model-args '{"layers":4,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}' --device ${DEV:-cuda} --dtype float32 --optimizer adam --lr 1e-3 --steps 6 --microbatches 4 --microbatch-size 2 --timeout 60 --lr-warmup 2 --lr-decay cosine --min-lr 1e-4 --eval-every 2 --eval-batches 3)
python3 - <<'P'
from pipeflow.spec import build_model
from tests.conftest import write_plan
n = len(build_model("gpt", {"layers":4,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}).layers)
write_plan(__import__("pathlib").Path("/tmp/evlr/dp.json"), "1f1b", 4, [(n, 2)])
P
run() { name=$1; np=$2; shift 2; env $ENVS timeout 90 mpirun -np $np python3 -m pipeflow.train "${A[@]}" "$@" --save $D/$name.pt > $D/$name.log 2>&1; echo "$name rc=$?"; grep -E 'eval loss|rror' $D/$name.log | grep -v '^\[rank 1\]' | tr '\n' ' ' | cut -c1-400; echo; grep -E 'step 6/6' $D/$name.log | head -1; }
ENVS=""
run one 1
run pp 2 --schedule 1f1b --layers-per-stage even
ENVS="PIPEFLOW_P2P=nccl"; run ppnccl 2 --schedule 1f1b --layers-per-stage even
ENVS=""
run gpipe 2 --schedule gpipe --layers-per-stage even
run dp 2 --plan $D/dp.json
run bw 2 --schedule 2bw --layers-per-stage even --checkpoint-dir $D/ck-bw --checkpoint-every 2
run as 2 --schedule async --layers-per-stage even --checkpoint-dir $D/ck-as --checkpoint-every 2
python3 - <<'P'
import re, torch
L = lambda n: torch.load(f"/tmp/evlr/{n}.pt", map_location="cpu", weights_only=True)
def diff(a, b):
    a, b = L(a), L(b); return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
def evals(n):
    return [float(x) for x in re.findall(r"eval loss ([0-9.]+)", open(f"/tmp/evlr/{n}.log").read())]
print("one evals", evals("one"))
for other in ("pp", "ppnccl", "gpipe", "dp"):
    try: print(f"{other} vs one: weights max |diff| {diff(other, 'one'):.3e}; evals {evals(other)}")
    except Exception as e: print(other, "failed", e)
for other in ("bw", "as"):
    try: print(f"{other}: evals {evals(other)}; weights vs one {diff(other, 'one'):.3e}")
    except Exception as e: print(other, "failed", e)
P
