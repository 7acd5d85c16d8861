#!/bin/bash
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; date -u
M='{"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000, "dataset": "synthetic"}'
for acc in gemm autograd gemm autograd; do
  r=$(PIPEFLOW_GRAD_ACCUM=$acc timeout 60 mpirun -np 2 python3 -m pipeflow.train --model gpt --model-args "$M" --device cuda --dtype bfloat16 --optimizer adam --lr 1e-4 --steps 10 --log-every 5 --microbatch-size 2 --microbatches 32 --layers-per-stage 14,12 --schedule 1f1b --timeout 50 2>&1 | grep -o "steady state.*tokens/s")
  echo "W6 $acc: $r"
done
