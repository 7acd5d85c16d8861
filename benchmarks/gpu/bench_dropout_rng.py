"""What seeding dropout per (seed, microbatch, layer) costs: forward + backward of a GPT stack with dropout
through pipeflow's Stage, seeded (as pipeflow-train runs it) against the same layers run as one
nn.Sequential with plain dropout, and without dropout; one process, no MPI (docs/reproducibility.md).

    python benchmarks/gpu/bench_dropout_rng.py                      # tiny, on cpu
    python benchmarks/gpu/bench_dropout_rng.py --device cuda --layers 24 --d-model 1024 --heads 16 \\
        --seq-len 1024 --microbatch-size 8 --dtype bfloat16 --iters 50

Prints one line: ms per microbatch seeded and plain, their ratio, and the time without dropout.
The variants run interleaved in rounds; each number is the median over rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from pipeflow.data.loader import MicrobatchLoader
from pipeflow.models.gpt import build
from pipeflow.stage import Stage, to_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def make_stage(args: argparse.Namespace, dropout: float, device: torch.device, *, seeded: bool) -> Stage:
    torch.manual_seed(0)
    spec = build(layers=args.layers, d_model=args.d_model, heads=args.heads, seq_len=args.seq_len,
                 vocab=args.vocab, dataset="synthetic", dataset_size=max(64, args.microbatch_size), dropout=dropout)
    stage = Stage(spec.layers, start=0, first=True, last=True, loss_fn=spec.loss_fn, device=device,
                  dtype=DTYPES[args.dtype], seed=0)
    if not seeded:  # plain: the layers as one nn.Sequential, dropout drawing from the running generator
        stage.run_layers = lambda t, x: stage.module(x)  # type: ignore[method-assign]
    return stage


def time_rounds(stage: Stage, batch: tuple[Any, Any], device: torch.device, iters: int) -> float:
    """ms per microbatch of `iters` forward + backward passes."""
    x, y = batch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for t in range(iters):
        stage.forward(t, x, y, global_mb=t)
        stage.backward(t, None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for p in stage.parameters():
        p.grad = None
    return (time.perf_counter() - t0) * 1e3 / iters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--iters", type=int, default=10, help="microbatches per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_dropout_rng: error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if min(args.layers, args.d_model, args.heads, args.seq_len, args.microbatch_size, args.iters, args.rounds) < 1:
        print("bench_dropout_rng: error: sizes, --iters and --rounds must be >= 1", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda":  # set_device needs an index on older torch (2.11 on the GPU machines)
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    stages = {"seeded": make_stage(args, args.dropout, device, seeded=True),
              "plain": make_stage(args, args.dropout, device, seeded=False),
              "none": make_stage(args, 0.0, device, seeded=False)}
    spec_data = build(seq_len=args.seq_len, vocab=args.vocab, dataset="synthetic",
                      dataset_size=max(64, args.microbatch_size), layers=1, d_model=8, heads=1).dataset
    batch = to_device(MicrobatchLoader(spec_data, args.microbatch_size).microbatch(0), device)
    times: dict[str, list[float]] = {k: [] for k in stages}
    for stage in stages.values():  # warm-up: allocator, kernels, autotuning
        time_rounds(stage, batch, device, 2)
    for _ in range(args.rounds):
        for name, stage in stages.items():
            times[name].append(time_rounds(stage, batch, device, args.iters))
    ms = {k: statistics.median(v) for k, v in times.items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bench_dropout_rng: {name}, gpt {args.layers}x{args.d_model} seq {args.seq_len} microbatch "
          f"{args.microbatch_size} {args.dtype}, dropout {args.dropout}: seeded {ms['seeded']:.3f} ms/microbatch, "
          f"plain {ms['plain']:.3f} ms/microbatch, ratio {ms['seeded'] / ms['plain']:.3f} "
          f"(no dropout {ms['none']:.3f} ms; {args.layers + 2} seeded layers per microbatch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
