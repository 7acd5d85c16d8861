#!/bin/bash
# 2026-12-05 C, one H200: this session's planner changes on a GPU (ties in bf16; the planner's memory: boundary
# tensors, buffers, frozen weights), the suite again, and the plan's predicted peak beside the measured one
source .dev/device-env.sh >/dev/null || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u +%H:%M:%S
timeout 300 python3 -m pytest -q -p no:cacheprovider tests --tb=short -rf > $OUT/pytest.txt 2>&1
grep -E '^(FAILED|ERROR)|passed|failed' $OUT/pytest.txt | tail -8
date -u +%H:%M:%S
D=/tmp/tie; mkdir -p $D
python3 -m partitioner.profiler --model gpt --model-args '{"layers": 4, "d_model": 512, "heads": 8, "seq_len": 256, "vocab": 8000, "tie": true}' --microbatch-size 4 --device cuda --dtype bfloat16 -o $D/p.json 2>&1 | tail -1
python3 -c "import json; print('ties', json.load(open('$D/p.json')).get('ties'))"
python3 -m partitioner.cli $D/p.json --workers 2 --schedule async --straight -o $D/plan.json --topology 2x300GB/s 2>&1 | tail -1
python3 -m partitioner.cli $D/p.json --workers 2 --schedule 2bw -o $D/plan.json --topology 2x300GB/s 2>&1 | tail -2
mkdir -p /tmp/bw
timeout 240 python3 benchmarks/gpu/bench.py --gpus 1 --steps 8 --timeout 120 --work /tmp/bw --out $OUT/res.md \
  --rows "pf 1f1b 8 8 26; pf gpipe 4 16 26" 2>&1 | grep -E "RESULT|Error|error|Traceback"
python3 - <<'P'
import glob, json
for f in sorted(glob.glob("/tmp/bw/plan-*.json")):
    print(f.split("/")[-1], "predicted peak GiB", [round(b / 2**30, 2) for b in json.load(open(f))["predicted"]["peak_memory_bytes"]])
P
date -u +%H:%M:%S
