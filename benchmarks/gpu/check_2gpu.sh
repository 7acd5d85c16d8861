#!/usr/bin/env bash
# Round-1 GPU check on 2 GPUs: throughput vs torch in one call, and NCCL smoke runs of the new seams.
set -u
source "${DEVICE_ENV:-.dev/device-env.sh}" || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=8 PIPEFLOW_LOG=INFO
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
GPT='{"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000, "dataset": "synthetic"}'
common=(--model gpt --model-args "$GPT" --dtype bfloat16 --device cuda --optimizer adam --lr 1e-4 --steps 12 --log-every 4)
pf() { # name mb m schedule split extra...
  local name=$1 mb=$2 m=$3 sch=$4 split=$5; shift 5
  timeout 240 mpirun -np 2 python3 -m pipeflow.train "${common[@]}" --microbatch-size $mb --microbatches $m --schedule $sch --layers-per-stage $split "$@" > /tmp/pf-$name.log 2>&1
  echo "RESULT pf-$name rc=$? $(grep -o '[0-9.]* tokens/s' /tmp/pf-$name.log | tail -1) peak=$(grep -o 'peak GPU memory per rank (GiB): .*' /tmp/pf-$name.log | cut -d: -f2) $(grep -o 'sends held: .*' /tmp/pf-$name.log | head -1)"
  grep -iE "error|Traceback|warn" /tmp/pf-$name.log | head -5
}
pf 1f1b-8x8 8 8 1f1b 14,12
timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gpu/bench_torch_pp.py --schedule 1F1B --split 14,12 --steps 12 --microbatches 8 --microbatch-size 8 2>&1 | grep -E "RESULT|Error" | head -3
pf 2bw-8x8 8 8 2bw 14,12
SMALL='{"layers": 8, "d_model": 512, "heads": 8, "seq_len": 256, "vocab": 32000, "dataset": "synthetic", "tie": true, "dropout": 0.1}'
for sch in 1f1b gpipe; do
  timeout 200 mpirun -np 2 python3 -m pipeflow.train --model gpt --model-args "$SMALL" --device cuda --schedule $sch --layers-per-stage even --microbatch-size 4 --microbatches 8 --steps 20 --log-every 10 > /tmp/tied-$sch.log 2>&1
  echo "RESULT tied+dropout $sch rc=$? $(grep -o 'loss [0-9.]*' /tmp/tied-$sch.log | tr '\n' ' ')"; grep -iE "error|Traceback" /tmp/tied-$sch.log | head -5
done
# a replicated stage (data parallel over 2 GPUs) with the on-the-spot planner
timeout 200 mpirun -np 2 python3 -m pipeflow.train --model gpt --model-args '{"layers": 4, "d_model": 256, "heads": 4, "seq_len": 128, "dataset": "synthetic", "dropout": 0.1}' --device cuda --microbatch-size 4 --microbatches 8 --steps 20 --log-every 10 > /tmp/spot.log 2>&1
echo "RESULT on-the-spot rc=$? $(grep -o 'planned for.*' /tmp/spot.log | head -1 | cut -c1-200) $(grep -o 'loss [0-9.]*' /tmp/spot.log | tr '\n' ' ')"; grep -iE "error|Traceback" /tmp/spot.log | head -5
