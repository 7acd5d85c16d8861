#!/bin/bash
# 2026-12-05 D, one H200: the loss's saved tensors per microbatch in flight (loss_saved_bytes): gpipe 4 x 16 on one
# stage (C: measured 112.97 GiB, priced 108.08 counting the loss once), beside 1f1b 8 x 8
source .dev/device-env.sh >/dev/null || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u +%H:%M:%S; mkdir -p /tmp/bw
timeout 300 python3 benchmarks/gpu/bench.py --gpus 1 --steps 6 --timeout 150 --work /tmp/bw --out $OUT/res.md \
  --rows "pf gpipe 4 16 26; pf 1f1b 8 8 26" 2>&1 | grep -E "RESULT|Error|error|Traceback"
python3 - <<'P'
import glob, json
for f in sorted(glob.glob("/tmp/bw/plan-*.json")):
    print(f.split("/")[-1], "predicted peak GiB", [round(b / 2**30, 2) for b in json.load(open(f))["predicted"]["peak_memory_bytes"]])
for f in sorted(glob.glob("/tmp/bw/profile-*.json")):
    d = json.load(open(f)); print(f.split("/")[-1], "loss_bytes GiB", round(d["loss_bytes"] / 2**30, 3), "loss_saved_bytes GiB", round(d.get("loss_saved_bytes", 0) / 2**30, 3))
P
date -u +%H:%M:%S
