"""The profile against the stage: does pipeflow-profile's sum over the layers give what a pipeflow Stage holding
those layers takes per microbatch? One process, no MPI, no communication: only the profiler's timing
conditions (each layer alone, one autograd call per layer) against the runtime's (the layers back to back,
one call per stage and microbatch).

    python benchmarks/gpu/bench_profile_vs_stage.py                         # tiny GPT, cpu
    python benchmarks/gpu/bench_profile_vs_stage.py --device cuda --dtype bfloat16 --layers 6 --d-model 2048 \\
        --heads 16 --seq-len 1024 --vocab 32000 --microbatch-sizes 1,2,4,8

Prints, per microbatch size, ms per microbatch: the profile's forward + accumulating backward + loss summed
over the layers, timed two ways (on CUDA: each call from an idle device, as pipeflow-profile does, and the
kernels back to back, the launches hidden behind a held device, as pipeflow-profile --timing kernels does; the
same on CPU),
the Stage's forward + backward (the median of --rounds rounds of --iters microbatches, synchronised only at a
round's ends), and the ratios. The planner prices a stage from the profile.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
from bench_dropout_rng import time_rounds  # this folder: the same Stage loop, timed the same way

from partitioner.profiler import DTYPES, profile_model
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.models.gpt import build
from pipeflow.stage import Stage, to_device


def stage_ms(args: argparse.Namespace, b: int, device: torch.device) -> float:
    """Median ms per microbatch of the whole model as one Stage, forward then backward, back to back."""
    torch.manual_seed(0)
    spec = build(**model_args(args))
    stage = Stage(spec.layers, start=0, first=True, last=True, loss_fn=spec.loss_fn, device=device,
                  dtype=DTYPES[args.dtype], seed=0)
    x, y = (to_device(t, device) for t in MicrobatchLoader(spec.dataset, b, seed=0).microbatch(0))
    rounds = [time_rounds(stage, (x, y), device, args.iters) for _ in range(args.rounds + 1)]
    return statistics.median(rounds[1:])  # the first round warms up


def profile_ms(args: argparse.Namespace, b: int, device: torch.device, *, held: bool) -> float:
    """The profile's price of one microbatch through every layer: forward + accumulating backward + loss;
    `held` times the kernels back to back (pipeflow-profile --timing kernels) instead of each call from an idle
    device (--timing idle)."""
    torch.manual_seed(0)
    prof = profile_model(build(**model_args(args)), b, device, dtype=args.dtype, optimizer=None,
                         timing="kernels" if held and device.type == "cuda" else "idle")
    per_layer = sum(layer.forward_ms + (layer.backward_accumulate_ms or layer.backward_ms) for layer in prof.layers)
    return per_layer + (prof.loss_ms or 0.0)


def model_args(args: argparse.Namespace) -> dict[str, object]:
    return dict(layers=args.layers, d_model=args.d_model, heads=args.heads, seq_len=args.seq_len, vocab=args.vocab,
                dataset="synthetic", dataset_size=64)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--microbatch-sizes", default="2,8")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_profile_vs_stage: error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as a rank under mpirun (the profiler does the same)
    print(f"GPT {model_args(args)} on {device} ({args.dtype}); ms per microbatch")
    print("| microbatch | profile, each call from an idle device (pipeflow-profile) | profile, kernels back to back "
          "| Stage (back to back) | idle / Stage | hidden / Stage |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in (int(s) for s in args.microbatch_sizes.split(",")):
        idle, hidden = profile_ms(args, b, device, held=False), profile_ms(args, b, device, held=True)
        stage = stage_ms(args, b, device)
        print(f"| {b} | {idle:.3f} | {hidden:.3f} | {stage:.3f} | {idle / stage:.3f} | {hidden / stage:.3f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
