#!/bin/bash
# K: CUDA graphs (PIPEFLOW_CUDA_GRAPHS=1): the in-process GPU tests, eager vs graphed pipeflow-train weights on 2 GPUs,
# then 1f1b 2 x 32 on 14,12 eager and graphed, alternated
source .dev/device-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; date -u +%H:%M:%S
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py 2>&1 | tail -25
D=/tmp/gq; rm -rf $D; mkdir -p $D
A=(--model gpt --model-args '{"layers":4,"d_model":256,"heads":4,"seq_len":128,"vocab":1000}' --device cuda --dtype float32 --optimizer adam --lr 1e-3 --steps 6 --microbatches 4 --microbatch-size 2 --timeout 60 --layers-per-stage even --log-every 1)
for s in 1f1b gpipe; do for g in 0 1; do
  PIPEFLOW_CUDA_GRAPHS=$g timeout 90 mpirun -np 2 python3 -m pipeflow.train "${A[@]}" --schedule $s --save $D/$s-$g.pt > $D/$s-$g.log 2>&1; echo "$s graphs=$g rc=$?"
  grep -E "step [0-9]/6|rror" $D/$s-$g.log | grep -v "^\[rank 0\]" | sed 's/.*step/step/' | cut -c1-40 | tr '\n' ' '; echo
done; done
cp $D/*.log $OUT/ 2>/dev/null
python3 - <<'P'
import torch
L = lambda n: torch.load(f"/tmp/gq/{n}.pt", map_location="cpu", weights_only=True)
for s in ("1f1b", "gpipe"):
    try:
        a, b = L(f"{s}-0"), L(f"{s}-1")
        print(s, "max |eager - graphed|", max((a[k].float() - b[k].float()).abs().max().item() for k in a))
    except Exception as e:
        print(s, "compare failed", e)
P
date -u +%H:%M:%S
mkdir -p /tmp/bw
for g in 0 1 0 1; do
  E=""; [ $g = 1 ] && E=" env:PIPEFLOW_CUDA_GRAPHS=1"
  timeout 200 python3 benchmarks/gpu/bench.py --gpus 2 --steps 10 --timeout 180 --work /tmp/bw --rows "pf 1f1b 2 32 14,12$E" --out $OUT/res-$g.md 2>&1 | grep -E "RESULT|Error|error|Traceback" | sed "s/^/graphs=$g /"
done
ls /tmp/bw/ | head; date -u +%H:%M:%S
find /tmp/bw -name "*.log" -newer /tmp/gq -size -2M -exec cp {} $OUT/ \; 2>/dev/null; ls $OUT | head -30
