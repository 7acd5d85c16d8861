#!/bin/bash
# 2026-12-05 B, one H200: name the suite's second failure on a GPU machine (A cut it off), at this session's code
source .dev/device-env.sh >/dev/null || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u +%H:%M:%S; git log --oneline | head -1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests --tb=short -rf > $OUT/pytest.txt 2>&1
grep -E '^(FAILED|ERROR)|passed|failed' $OUT/pytest.txt | tail -8
date -u +%H:%M:%S
# the tied GPT profiled on CUDA: its ties, and a 2-worker async plan that keeps the tie on one stage
D=/tmp/tie; mkdir -p $D
python3 -m partitioner.profiler --model gpt --model-args '{"layers": 4, "d_model": 512, "heads": 8, "seq_len": 256, "vocab": 8000, "tie": true}' --microbatch-size 4 --device cuda --dtype bfloat16 -o $D/p.json 2>&1 | tail -1
python3 -c "import json; print('ties', json.load(open('$D/p.json')).get('ties'))"
python3 -m partitioner.cli $D/p.json --workers 2 --schedule async -o $D/plan.json --topology 2x300GB/s 2>&1 | tail -3
python3 -m partitioner.cli $D/p.json --workers 2 --schedule 1f1b --straight -o $D/plan2.json --topology 2x300GB/s 2>&1 | tail -4
date -u +%H:%M:%S
