#!/bin/bash
# M: CUDA graphs with replicas and tied weights: the GPU tests, eager vs graphed weights on 2 GPUs (1f1b with the
# embedding and head tied across the stages, data parallelism, gpipe), then the planner's data-parallel plan at 2 x 32
# and 8 x 8, eager and graphed, alternated
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py 2>&1 | tail -3
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
  PIPEFLOW_CUDA_GRAPHS=$g timeout 90 mpirun -np 2 python3 -m pipeflow.train "${A[@]}" "$@" --save $D/$name-$g.pt > $D/$name-$g.log 2>&1; echo "$name graphs=$g rc=$?"
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
mkdir -p /tmp/bw
G=env:PIPEFLOW_CUDA_GRAPHS=1
timeout 420 python3 benchmarks/gpu/bench.py --gpus 2 --steps 10 --timeout 180 --work /tmp/bw --out $OUT/res.md --rows "pf 1f1b 2 32 plan; pf 1f1b 2 32 plan $G; pf 1f1b 8 8 plan; pf 1f1b 8 8 plan $G; pf 1f1b 2 32 plan; pf 1f1b 2 32 plan $G" 2>&1 | grep -E "RESULT|Error|error|Traceback"
date -u +%H:%M:%S
mkdir -p $OUT/bw; find /tmp/bw -name "pf-*.log" -size -2M -exec cp {} $OUT/bw/ \; 2>/dev/null
