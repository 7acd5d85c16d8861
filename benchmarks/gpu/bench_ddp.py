"""Baseline: torch DDP on the same GPT and optimizer, the same sequences per step, for the side-by-side table.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gpu/bench_ddp.py --microbatch-size 8
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu/bench_ddp.py   # the 1-GPU row

Each rank takes sequences/world of every step in microbatches of --microbatch-size, accumulating gradients
without synchronising (DDP's no_sync) until the last, whose backward all-reduces them; then fused Adam.
Prints one line `RESULT ddp ranks=<n> mb=<b> tokens_per_s=<...> peak_gib=<...>` on rank 0.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from pipeflow.spec import build_model

GPT = {"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000, "dataset": "synthetic"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--microbatch-size", type=int, default=8)
    p.add_argument("--sequences", type=int, default=64, help="sequences per optimizer step, over all ranks")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model-args", default=json.dumps(GPT))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": dev} if cuda else {}))
    per_rank = args.sequences // world
    if per_rank * world != args.sequences or per_rank % args.microbatch_size:
        raise SystemExit(f"--sequences {args.sequences} must split into {world} ranks x microbatches of "
                         f"{args.microbatch_size}")
    m = per_rank // args.microbatch_size
    cfg = json.loads(args.model_args)
    spec = build_model("gpt", cfg, seed=0)
    model: nn.Module = nn.Sequential(*spec.layers).to(dev, getattr(torch, args.dtype))
    loss_fn = spec.loss_fn
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=cuda or None)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg["vocab"], (per_rank, cfg["seq_len"]), generator=g).to(dev)
    y = torch.randint(0, cfg["vocab"], (per_rank, cfg["seq_len"]), generator=g).to(dev)
    t0 = 0.0
    for k in range(args.warmup + args.steps):
        if k == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
        for i in range(m):
            last = i == m - 1
            sync = contextlib.nullcontext() if last or world == 1 else model.no_sync()  # type: ignore[operator]
            with sync:
                sl = slice(i * args.microbatch_size, (i + 1) * args.microbatch_size)
                (loss_fn(model(x[sl]), y[sl]) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    if world > 1:
        dist.barrier()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else float("nan")
    if world > 1:
        t = torch.tensor([peak], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak = float(t[0])
    if rank == 0:
        tps = args.steps * args.sequences * cfg["seq_len"] / dt
        print(f"RESULT ddp ranks={world} mb={args.microbatch_size} tokens_per_s={tps:.0f} peak_gib={peak:.1f}",
              flush=True)
    if world > 1:
        dist.barrier()  # no rank tears down while another still talks (gloo aborts on that)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
