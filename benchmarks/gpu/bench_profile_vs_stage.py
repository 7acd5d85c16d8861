"""The profile against the stage: does pipeflow-profile's sum over the layers give what a pipeflow Stage holding
those layers takes per microbatch? One process, no MPI, no communication: only the profiler's timing
conditions (each layer alone, from an idle device, one autograd call per layer) against the runtime's (the
layers back to back, one call per stage and microbatch).

    python benchmarks/gpu/bench_profile_vs_stage.py                         # tiny GPT, cpu
    python benchmarks/gpu/bench_profile_vs_stage.py --device cuda --dtype bfloat16 --layers 6 --d-model 2048 \\
        --heads 16 --seq-len 1024 --vocab 32000 --microbatch-sizes 2,8

Prints, per microbatch size, ms per microbatch: the profile's forward + accumulating backward + loss summed
over the layers, the Stage's forward + backward (the median of --rounds rounds of --iters microbatches,
synchronised only at a round's ends), and their ratio; then what timing a layer alone adds per call (the
blocks timed alone against the blocks as one call, forward and backward) and the profile with that taken off
every layer but one (a stage pays it once per microbatch), against the Stage. The planner prices a stage from
the first number.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
from bench_dropout_rng import time_rounds  # this folder: the same Stage loop, timed the same way

from partitioner.measure import Timer
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


def profile_ms(args: argparse.Namespace, b: int, device: torch.device) -> float:
    """The profile's price of one microbatch through every layer: forward + accumulating backward + loss."""
    torch.manual_seed(0)
    prof = profile_model(build(**model_args(args)), b, device, dtype=args.dtype, optimizer=None)
    per_layer = sum(layer.forward_ms + (layer.backward_accumulate_ms or layer.backward_ms) for layer in prof.layers)
    return per_layer + (prof.loss_ms or 0.0)


def call_overhead_ms(args: argparse.Namespace, b: int, device: torch.device, repeats: int = 7) -> tuple[float, float]:
    """What timing a layer alone adds per call, forward and backward, in the profiler's conditions (measure.Timer:
    from an idle device, one autograd call per layer): (sum over the blocks timed alone - the blocks timed as
    one call) / (blocks - 1), the median of `repeats`."""
    torch.manual_seed(0)
    spec = build(**model_args(args))
    layers = [layer.to(device=device, dtype=DTYPES[args.dtype]) for layer in spec.layers]
    x, _ = MicrobatchLoader(spec.dataset, b, seed=0).microbatch(0)
    with torch.no_grad():
        h = layers[0](to_device(x, device)).detach().requires_grad_(True)  # the first block's input
    blocks, timer = layers[1:-1], Timer(device)

    def forward_backward(chain: list[torch.nn.Module]) -> tuple[float, float]:
        out: dict[str, torch.Tensor] = {}

        def forward() -> None:
            y = h
            for block in chain:
                y = block(y)
            out["y"] = y
        t_f = timer(forward)
        grad = torch.randn_like(out["y"])
        return t_f, timer(lambda: torch.autograd.backward(out["y"], grad))

    runs = []
    for _ in range(repeats + 1):  # the first warms up
        alone = [forward_backward([block]) for block in blocks]
        chain = forward_backward(blocks)
        runs.append(tuple((sum(a[k] for a in alone) - chain[k]) / (len(blocks) - 1) for k in (0, 1)))
    return statistics.median(r[0] for r in runs[1:]), statistics.median(r[1] for r in runs[1:])


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
    print("| microbatch | profile (sum over layers) | Stage (back to back) | profile / Stage | per-call overhead "
          "F, B | profile less it on all layers but one | that / Stage |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    layers = args.layers + 2  # the embedding, the blocks, the head
    for b in (int(s) for s in args.microbatch_sizes.split(",")):
        prof, stage = profile_ms(args, b, device), stage_ms(args, b, device)
        o_f, o_b = call_overhead_ms(args, b, device)
        fixed = prof - (layers - 1) * (o_f + o_b)
        print(f"| {b} | {prof:.3f} | {stage:.3f} | {prof / stage:.3f} | {o_f:.3f}, {o_b:.3f} | {fixed:.3f} | "
              f"{fixed / stage:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
