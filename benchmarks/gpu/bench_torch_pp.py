"""Baseline: torch.distributed.pipelining on the same GPT, for a side-by-side run with pipeflow.

    python3 -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/gpu/bench_torch_pp.py \
        --schedule 1F1B --split 8,6,6,6 --steps 12
    ... --schedule Interleaved1F1B --split 4,3,3,3,3,3,3,4      # 2 stages per rank (looped placement)

--split: layers per stage (the embedding and the head count as layers); the interleaved schedules take
2 x ranks stages, stage k on rank k mod ranks. Prints one line
`RESULT torch-<schedule> split=<...> mb=<b> m=<m> tokens_per_s=<...> peak_gib=<...>` on rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as pp

from pipeflow.spec import build_model

GPT = {"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000, "dataset": "synthetic"}
SCHEDULES = {"1F1B": "Schedule1F1B", "GPipe": "ScheduleGPipe", "Interleaved1F1B": "ScheduleInterleaved1F1B",
             "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1F1B")
    p.add_argument("--split", default="8,6,6,6", help="layers per stage (embedding and head count as layers)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--model-args", default=json.dumps(GPT))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    counts = [int(x) for x in args.split.split(",")]
    per_rank = 1 if args.schedule in ("1F1B", "GPipe") else 2
    if len(counts) != world * per_rank:
        raise SystemExit(f"--split has {len(counts)} stages; --schedule {args.schedule} on {world} ranks needs "
                         f"{world * per_rank}")
    cfg = json.loads(args.model_args)
    spec = build_model("gpt", cfg, seed=0)
    if sum(counts) != len(spec.layers):
        raise SystemExit(f"--split {args.split} covers {sum(counts)} layers, the model has {len(spec.layers)}")
    n_stages = len(counts)
    mine = [k for k in range(n_stages) if k % world == rank]  # looped placement
    stages, params = [], []
    for k in mine:
        start = sum(counts[:k])
        sub = nn.Sequential(*spec.layers[start:start + counts[k]]).to(dev, getattr(torch, args.dtype))
        params += list(sub.parameters())
        stages.append(pp.PipelineStage(sub, k, n_stages, dev))
    del spec
    loss = lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))  # noqa: E731
    cls = getattr(pp, SCHEDULES[args.schedule])
    sched = (cls(stages[0], n_microbatches=args.microbatches, loss_fn=loss) if per_rank == 1
             else cls(stages, n_microbatches=args.microbatches, loss_fn=loss))
    opt = torch.optim.Adam(params, lr=1e-4, fused=cuda or None)
    n = args.microbatches * args.microbatch_size
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, cfg["vocab"], (n, cfg["seq_len"]), generator=g).to(dev)
    y = torch.randint(0, cfg["vocab"], (n, cfg["seq_len"]), generator=g).to(dev)
    first, last = 0 in mine, n_stages - 1 in mine
    t0 = 0.0
    for k in range(args.warmup + args.steps):
        if k == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
        kwargs = {"target": y, "losses": []} if last else {}
        if first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    dt = time.perf_counter() - t0
    peak = torch.tensor([torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else float("nan")], device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        tps = args.steps * n * cfg["seq_len"] / dt
        print(f"RESULT torch-{args.schedule} split={args.split} mb={args.microbatch_size} m={args.microbatches} "
              f"tokens_per_s={tps:.0f} peak_gib={float(peak[0]):.1f}", flush=True)
    dist.barrier()  # no rank tears down while another still talks (gloo aborts on that)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
