"""Baseline: torch.distributed.pipelining on the same GPT, for a side-by-side run with pipeflow.

    python3 -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/gpu/bench_torch_pp.py \
        --schedule 1F1B --split 8,6,6,6 --steps 12

Prints one line `RESULT torch-<schedule> split=<...> tokens_per_s=<...> peak_gib=<...>` on rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from pipeflow.spec import build_model

GPT = {"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000, "dataset": "synthetic"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", choices=("1F1B", "GPipe"), default="1F1B")
    p.add_argument("--split", default="8,6,6,6", help="layers per stage (embedding and head count as layers)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--model-args", default=json.dumps(GPT))
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    counts = [int(x) for x in args.split.split(",")]
    assert len(counts) == world, f"--split has {len(counts)} stages for {world} ranks"
    spec = build_model("gpt", json.loads(args.model_args), seed=0)
    start = sum(counts[:rank])
    sub = nn.Sequential(*spec.layers[start:start + counts[rank]]).to(dev, torch.bfloat16)
    del spec
    stage = PipelineStage(sub, rank, world, dev)
    cls = Schedule1F1B if args.schedule == "1F1B" else ScheduleGPipe
    sched = cls(stage, n_microbatches=args.microbatches, loss_fn=lambda out, y: nn.functional.cross_entropy(
        out.reshape(-1, out.shape[-1]).float(), y.reshape(-1)))
    opt = torch.optim.Adam(sub.parameters(), lr=1e-4, fused=True)
    cfg = json.loads(args.model_args)
    n = args.microbatches * args.microbatch_size
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, cfg["vocab"], (n, cfg["seq_len"]), generator=g).to(dev)
    y = torch.randint(0, cfg["vocab"], (n, cfg["seq_len"]), generator=g).to(dev)
    t0 = 0.0
    for k in range(args.warmup + args.steps):
        if k == args.warmup:
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dist.barrier()
    dt = time.perf_counter() - t0
    peak = torch.tensor([torch.cuda.max_memory_allocated(dev) / 2**30], device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        tps = args.steps * n * cfg["seq_len"] / dt
        print(f"RESULT torch-{args.schedule} split={args.split} tokens_per_s={tps:.0f} peak_gib={peak.item():.1f}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
