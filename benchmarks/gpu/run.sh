#!/usr/bin/env bash
# Side-by-side GPT benchmark on 4 GPUs of one host: pipeflow vs torch.distributed.pipelining.
# Run from the repository root on the GPU machine, after `source .dev/device-env.sh` (wheels for mpi4py/MPICH).
#   bash benchmarks/gpu/run.sh [which...]    which: smoke pf-1f1b pf-1f1b-fill pf-2bw pf-gpipe pf-1f1b-even
#                                                   torch-1f1b torch-gpipe torch-1f1b-even
# Results: lines `RESULT ...` on stdout (and in $OUT/results.txt when OUT is set).
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=8 PIPEFLOW_LOG=INFO
GPT='{"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000, "dataset": "synthetic"}'
STEPS=${STEPS:-12}
RES=${OUT:-/tmp}/results.txt
common=(--model gpt --model-args "$GPT" --microbatch-size 2 --microbatches 32 --dtype bfloat16 --device cuda
        --optimizer adam --lr 1e-4 --steps "$STEPS" --log-every 4)

pf() {  # name schedule split
  local log=/tmp/pf-$1.log
  timeout 300 mpirun -np 4 python3 -m pipeflow.train "${common[@]}" --schedule "$2" --layers-per-stage "$3" ${PF_EXTRA:-} 2>&1 | tee "$log" | grep -v "^\[rank [0-2]\] INFO pipeflow: step"
  local tps peak
  tps=$(grep -o 'steady state.*' "$log" | grep -o '[0-9.]* tokens/s' | cut -d' ' -f1)
  peak=$(grep -o 'peak GPU memory per rank (GiB): .*' "$log" | cut -d: -f2)
  echo "RESULT pipeflow-$1 split=$3 ctas=${PIPEFLOW_P2P_MAX_CTAS:-4} tokens_per_s=${tps:-FAILED} peak_gib=${peak:-?}" | tee -a "$RES"
}

tpp() {  # name schedule split
  timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/gpu/bench_torch_pp.py \
    --schedule "$2" --split "$3" --steps "$STEPS" 2>&1 | tee /tmp/torch-$1.log | grep -E "RESULT|Error|error" | tee -a "$RES"
}

for w in "${@:-smoke pf-1f1b torch-1f1b pf-gpipe torch-gpipe}"; do
  for x in $w; do
    echo "=== $x $(date +%T)"
    case $x in
      smoke) PIPEFLOW_STACK_DUMP_S=100 timeout 120 mpirun -np 4 python3 -m pipeflow.train --model gpt --device cuda \
               --steps 4 --log-every 2 2>&1 || { echo "RESULT smoke FAILED" | tee -a "$RES"; exit 1; } ;;
      pf-1f1b) pf 1f1b 1f1b 8,6,6,6 ;;
      pf-1f1b-even) pf 1f1b-even 1f1b 7,6,6,7 ;;
      pf-1f1b-fill) PF_EXTRA="--warmup fill" pf 1f1b-fill 1f1b 8,6,6,6 ;;
      pf-2bw) pf 2bw 2bw 8,6,6,6 ;;
      pf-gpipe) pf gpipe gpipe 8,6,6,6 ;;
      torch-1f1b) tpp 1f1b 1F1B 8,6,6,6 ;;
      torch-1f1b-even) tpp 1f1b-even 1F1B 7,6,6,7 ;;
      torch-gpipe) tpp gpipe GPipe 8,6,6,6 ;;
      *) echo "unknown benchmark $x" ;;
    esac
  done
done
