"""`pipeflow-profile`: time every layer's forward and backward and measure its output, saved-activation and
parameter bytes on a device (PipeDream SOSP'19 §3.1: the profile the partitioner plans from)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from torch import nn

from partitioner.chain import ROUND_GAP_S, ROUNDS, time_as_a_stage
from partitioner.companion import CompanionError, companion_devices, contention
from partitioner.layermem import check_microbatch_fits, loss_bytes, sandbox_copy
from partitioner.layertime import profile_layer
from partitioner.measure import (
    RANK_THREADS,
    Timer,
    as_a_rank,
    cast_floats_to,
    free_cached,
    gpu_link_bandwidth,
    map_tensors,
    noise_warning,
    optimizer_ms_per_byte,
    prepare_input,
    spread,
    time_loss,
)
from partitioner.outputs import check_output
from partitioner.profile import TIMINGS, LayerProfile, Profile, ProfileError
from partitioner.ties import find_ties
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.graphcheck import graphs_enabled
from pipeflow.spec import ModelError, ModelSpec, build_model, model_dtype, parse_model_args
from pipeflow.split import gemm_accumulation, splittable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
# --timing when not given, by device (False: CPU, True: CUDA). On 2 x H200 (benchmarks/gpu/README.md) the stage timing
# priced every row at microbatch 4 and 8 within 6% uncalibrated (kernels back to back: 11-15% fast, each call from an
# idle device over-priced microbatch 2 by 13-16%).
DEFAULT_TIMING = {False: "idle", True: "stage"}
CUDA_TIMINGS = ("kernels", "graphs")  # --timing values that time CUDA kernels: refused on a CPU
WORK = ("forward_ms", "backward_ms")  # a layer's round with the least of them is kept (--rounds, unchained)


def check_timing_device(timing: str | None, device: str) -> None:
    """A timing of CUDA kernels (CUDA_TIMINGS) needs --device cuda: ProfileError otherwise."""
    if timing in CUDA_TIMINGS and device != "cuda":
        raise ProfileError(f"--timing {timing} times CUDA kernels: it needs --device cuda, found {device}")


def default_timing(device: torch.device) -> str:
    """--timing when not given: DEFAULT_TIMING of the device; on CUDA under PIPEFLOW_CUDA_GRAPHS=1 "graphs", the
    chain as a graph replays it (the ranks will replay theirs, pipeflow/graphs.py)."""
    if device.type == "cuda" and graphs_enabled():
        return "graphs"
    return DEFAULT_TIMING[device.type == "cuda"]


def profile_model(spec: ModelSpec, microbatch_size: int, device: str | torch.device = "cpu", *,
                  dtype: str | None = None, warmup: int = 2, repeats: int = 5, seed: int = 0,
                  optimizer: str | None = "adam", threads: int | None = None,
                  warnings: list[str] | None = None, timing: str | None = None, gemm: bool | None = None,
                  ranks_per_host: int = 1, rounds: int | None = None) -> Profile:
    """Profile every layer of `spec` on one real microbatch of its dataset, in order (in-process API); then the loss
    on the last layer's output, a step of `optimizer` per parameter byte (None: not timed) and the layers' ties.

    The backward is timed twice per repeat: with no gradients yet (backward_ms) and accumulating into them
    (backward_accumulate_ms, every microbatch of a flushed step but the first; inside the weight GEMMs where the
    ranks accumulate there, PIPEFLOW_GRAD_ACCUM, pipeflow/split.py). `threads` torch threads
    (None: the process's own, as planning on the spot in a rank uses); a noisy machine (repeats
    disagreeing by more than measure.NOISY_SPREAD) appends a line to `warnings`.

    `dtype` None profiles in the model's own dtype, as pipeflow-train runs it without --dtype; floating
    inputs are cast to the dtype of the first floating-point parameter (pipeflow.stage.model_dtype).
    Each layer is measured on a deep copy, freed after, with the global CPU and CUDA generators saved and
    restored: the user's layers and RNG are left exactly as they were. On CPU freed memory is kept from then on,
    as in a rank (measure.as_a_rank).

    `timing`: on CUDA "idle" times each call from an idle device, "kernels" its kernels back to back with the
    launches hidden (measure.Timer says what each misses); "stage" (CUDA or CPU) times the layers as a stage
    runs them, the whole chain's forward then its backward with no wait between layers (measure.time_chain).
    None: DEFAULT_TIMING of the device. Recorded in the profile.

    `gemm` (None: on CUDA): with --timing stage, PIPEFLOW_GRAD_ACCUM unset and an nn.Linear in the model, the
    chain is timed a second time with each nn.Linear adding its weight gradient inside the GEMM, into the layers'
    *_gemm_ms fields, so that pipeflow-plan can choose the faster (partitioner/accumulation.py).

    `rounds` (None: chain.ROUNDS of the device, 5 on CUDA, 1 on CPU): --timing stage times the chain that many
    times, half a second apart, and keeps the fastest (a host whose pace moves from second to second). Given
    with the other timings (idle, kernels), every layer is timed that many times in turn, ROUND_GAP_S between
    rounds, and each layer keeps its fastest round's numbers (forward + backward).

    `ranks_per_host` > 1: after the rest, timed alone, the model's forward and backward passes are timed alone and
    beside that many - 1 companion processes (on CUDA, one on each next GPU) running the model, as a host's other
    ranks do; the ratio is the profile's `contention` (partitioner/companion.py)."""
    if dtype is not None and dtype not in DTYPES:
        raise ProfileError(f"--dtype must be one of {', '.join(DTYPES)}, found {dtype!r}")
    dev = torch.device(device)
    timing = timing or default_timing(dev)
    if timing not in TIMINGS:
        raise ProfileError(f"--timing must be one of {', '.join(TIMINGS)}, found {timing!r}")
    if warmup < 0 or repeats < 1:
        raise ProfileError(f"need --warmup >= 0 and --repeats >= 1, found {warmup} and {repeats}")
    per_layer_rounds = 1 if rounds is None or timing in ("stage", "graphs") else rounds
    rounds = ROUNDS[dev.type] if rounds is None else rounds
    if rounds < 1:
        raise ProfileError(f"--rounds must be >= 1, found {rounds}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("--device cuda, but torch sees no CUDA device; use --device cpu")
    check_timing_device(timing, dev.type)
    held = timing == "kernels"
    chained = timing in ("stage", "graphs")  # the layers timed as a stage runs them (chain.py)
    try:
        fuse = gemm_accumulation()  # as the ranks will accumulate (pipeflow/split.py)
        beside = companion_devices(dev.type, dev.index, ranks_per_host - 1,
                                   torch.cuda.device_count() if dev.type == "cuda" else 0)
    except (ValueError, CompanionError) as e:
        raise ProfileError(str(e)) from None
    if beside and not spec.name:
        raise ProfileError("ranks_per_host > 1 rebuilds the model in each companion: give it by name (build_model)")
    torch_dtype = DTYPES[dtype] if dtype is not None else None
    model = nn.ModuleList(spec.layers)
    in_dtype = torch_dtype or model_dtype(model)
    name = dtype or str(in_dtype or torch.float32).removeprefix("torch.")
    cuda_devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    layers: list[dict[str, Any]] = []
    timer = Timer(dev, held=timing != "idle")  # the loss and the optimizer step: after other work in a stage
    # fork_rng restores the CPU and this GPU's generators
    with torch.random.fork_rng(devices=cuda_devices), as_a_rank(dev, threads):
        check_microbatch_fits(spec, microbatch_size, dev, torch_dtype, seed, inputs=in_dtype)
        x, y = MicrobatchLoader(spec.dataset, microbatch_size, seed=seed).microbatch(0)
        x = cast_floats_to(x, in_dtype)
        first = x
        for r in range(per_layer_rounds):  # each layer's fastest round (an explicit --rounds, unchained)
            x = first
            if r:
                time.sleep(ROUND_GAP_S)
            for i, layer in enumerate(spec.layers):
                work = sandbox_copy(layer, dev, torch_dtype, fuse=fuse)
                stats, x = profile_layer(work, x, device=dev, dtype=None, warmup=warmup, repeats=repeats, held=held)
                del work
                free_cached(dev)
                stats["name"] = f"{i}:{stats['name']}"
                if r == 0 or sum(stats[k] for k in WORK) < sum(layers[i][k] for k in WORK):
                    layers[i:i + 1] = [stats]  # the first round appends, a faster one replaces
        try:
            target = map_tensors(y, lambda t: t.to(dev))
            peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None  # loss_bytes resets it
            loss_ms = time_loss(spec.loss_fn, prepare_input(x, dev, None), target, timer, warmup=warmup,
                                repeats=repeats)
            loss_mem, loss_kept = loss_bytes(spec.loss_fn, x, target, dev)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ProfileError(f"the model's loss failed on the last layer's output: {e}") from None
        chain, twin = None, None
        linears = any(splittable(m) for layer in spec.layers for m in layer.modules())  # else gemm changes nothing
        if chained and linears and "PIPEFLOW_GRAD_ACCUM" not in os.environ and (
                gemm if gemm is not None else dev.type == "cuda"):  # the knob set: the ranks accumulate its way
            twin = [dict(s) for s in layers]  # gemm accumulation's times, timed in turn with autograd's
        if chained:  # the loss as the last stage pays it, after its layers, over time_loss's alone
            chain, in_chain = time_as_a_stage(spec, layers, first, dev, torch_dtype, warmup=warmup, repeats=repeats,
                                              fuse=fuse, target=target, rounds=rounds, warnings=warnings, twin=twin,
                                              queued=timing == "graphs")
            loss_ms = loss_ms if in_chain is None else in_chain
        if twin is not None:
            for s, t in zip(layers, twin):
                s.update({f"{k.removesuffix('_ms')}_gemm_ms": t[k]
                          for k in ("forward_ms", "backward_ms", "backward_accumulate_ms")})
        rates = optimizer and optimizer_ms_per_byte(
            optimizer, (cast_floats_to(p.detach().to(dev), torch_dtype) for layer in spec.layers
                        for p in layer.parameters()), timer, warmup=warmup, repeats=repeats)
        opt, copy_ms = rates if rates else (None, None)
        try:  # beside companions: how much the host's other ranks slow this one (the layers above: alone)
            slower = beside and contention(spec, layers, first, dev, torch_dtype, warmup=warmup, repeats=repeats,
                                           fuse=fuse, devices=beside, warnings=warnings,
                                           config={"model": spec.name, "model_args": dict(spec.args), "dtype": dtype,
                                                   "microbatch_size": microbatch_size, "seed": seed,
                                                   "threads": threads})
        except CompanionError as e:
            raise ProfileError(f"--ranks-per-host {ranks_per_host}: {e}") from None
    passes = [sum(per_repeat) for per_repeat in zip(*(s.pop("_passes") for s in layers))]
    note = noise_warning(spread(chain or passes), repeats)
    if note and warnings is not None:
        warnings.append(note)
    return Profile(spec.name or "model", dict(spec.args), dev.type, name, microbatch_size,
                   [LayerProfile(**s) for s in layers], loss_ms, {optimizer: opt} if optimizer and opt else {},
                   link_bandwidth=gpu_link_bandwidth(dev), loss_bytes=loss_mem, loss_saved_bytes=loss_kept,
                   device_peak_bytes=None if peak is None else max(peak, torch.cuda.max_memory_allocated(dev)),
                   timing=timing if dev.type == "cuda" or timing == "stage" else None,
                   ranks_per_host=ranks_per_host if beside else None, contention=slower or None,
                   copy_ms_per_byte=copy_ms, ties=find_ties(spec.layers, torch_dtype) or None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipeflow-profile", description=__doc__)
    p.add_argument("--model", required=True, help="gpt, mlp or package.module:function")
    p.add_argument("--model-args", default=None, help="JSON object of keyword arguments for the model builder")
    p.add_argument("--microbatch-size", type=int, default=None)
    p.add_argument("--microbatch-sizes", default=None,
                   help="several sizes, e.g. 2,4,8: one file holding a profile per size (for pipeflow-plan "
                        "--global-batch); the first is the top level")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="cast the layers to this dtype (default: the dtype the model's builder gave it)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=None,
                   help="--timing stage: time the layers' chain this many times, 0.5 s apart, and keep the fastest "
                        "(default: 5 on cuda, where the host's pace may move from second to second; 1 on cpu); "
                        "with another timing, every layer that many times in turn, each keeping its fastest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="adam",
                   help="the optimizer whose step is timed (optimizer_ms_per_byte)")
    p.add_argument("--timing", choices=TIMINGS, default=None,
                   help="how layers are timed (default: stage on cuda, graphs there under PIPEFLOW_CUDA_GRAPHS=1, "
                        "idle on cpu). 'stage' (cuda or cpu): as a stage runs them, the chain's forward then its "
                        "backward, nothing waiting between layers; 'graphs' (cuda): the same with each pass's kernels "
                        "queued before the device runs them, as a CUDA graph replays them; 'idle': each layer's "
                        "call alone (on cuda from an idle device); 'kernels' (cuda): each layer's kernels back to "
                        "back, the launches hidden; see docs/formats.md")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch threads (default on cpu: {RANK_THREADS}, as each rank under mpirun)")
    p.add_argument("--ranks-per-host", type=int, default=1, metavar="N",
                   help="also time the model's passes beside N - 1 other processes (on cuda: on the next GPUs) "
                        "running its forward and backward, as the other ranks of a host will: profile.json's "
                        "contention, which pipeflow-plan applies as far as a plan's ranks compute at once (default 1)")
    p.add_argument("-o", "--output", required=True, help="profile.json to write")
    return p.parse_args(argv)


def _sizes(one: int | None, several: str | None) -> list[int]:
    """The microbatch sizes to profile, from --microbatch-size or --microbatch-sizes (exactly one given)."""
    if (one is None) == (several is None):
        raise ProfileError("give exactly one of --microbatch-size B and --microbatch-sizes B,B,...")
    if one is not None:
        if one < 1:
            raise ProfileError(f"--microbatch-size must be >= 1, found {one}")
        return [one]
    assert several is not None
    parts = [x.strip() for x in several.split(",")]
    if not all(x.isascii() and x.isdigit() and int(x) >= 1 for x in parts) or len(set(map(int, parts))) != len(parts):
        raise ProfileError(f"--microbatch-sizes must be distinct positive integers separated by commas, found "
                           f"{several!r}")
    return [int(x) for x in parts]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_output(args.output, "-o", ProfileError)  # before minutes of profiling
        sizes = _sizes(args.microbatch_size, args.microbatch_sizes)
        check_timing_device(args.timing, args.device)  # before the model is built
        model_args = parse_model_args(args.model_args)
        try:
            spec = build_model(args.model, model_args, seed=args.seed)
        except (ValueError, TypeError) as e:
            if isinstance(e, ModelError):
                raise
            raise ModelError(f"cannot build model {args.model!r} with --model-args {model_args}: {e}") from None
        if args.threads is not None and args.threads < 1:
            raise ProfileError(f"--threads must be >= 1, found {args.threads}")
        if args.ranks_per_host < 1:
            raise ProfileError(f"--ranks-per-host must be >= 1, found {args.ranks_per_host}")
        threads = args.threads or (RANK_THREADS if args.device == "cpu" else None)
        warnings: list[str] = []
        if args.device == "cpu" and threads != RANK_THREADS:
            warnings.append(f"--threads {threads}: ranks under mpirun run {RANK_THREADS} torch thread each, so "
                            "layer times measured here will not match training")
        prof, *others = [profile_model(spec, b, args.device, dtype=args.dtype, warmup=args.warmup,
                                       repeats=args.repeats, seed=args.seed, optimizer=args.optimizer,
                                       threads=threads, warnings=warnings, timing=args.timing,
                                       ranks_per_host=args.ranks_per_host, rounds=args.rounds) for b in sizes]
        prof.others = others
        prof.save(args.output)
    except (ModelError, ProfileError, OSError) as e:
        print(f"pipeflow-profile: error: {e}", file=sys.stderr)
        return 2
    total_f, total_b = (sum(getattr(layer, k) for layer in prof.layers) for k in ("forward_ms", "backward_ms"))
    print(f"profiled {len(prof.layers)} layers of {prof.model} on {prof.device} ({prof.dtype}, microbatch "
          f"{prof.microbatch_size}, {threads or torch.get_num_threads()} torch thread(s)"
          + (f"; contention {prof.contention:.3f} (a pass beside {args.ranks_per_host - 1} busy companion(s) over "
             "one alone)" if prof.contention else "")
          + f"): forward {total_f:.3f} "
          f"ms, backward {total_b:.3f} ms, loss {prof.loss_ms or 0:.3f} ms"
          + (f", GPU to GPU {prof.link_bandwidth / 1e9:.1f} GB/s" if prof.link_bandwidth else "")
          + (f"; with gemm accumulation forward {sum(x.forward_gemm_ms or 0 for x in prof.layers):.3f} ms, backward "
             f"{sum(x.backward_gemm_ms or 0 for x in prof.layers):.3f} ms"
             if prof.layers[0].forward_gemm_ms is not None else "")
          + (f"; also at microbatch sizes {', '.join(str(b) for b in sizes[1:])}" if others else "")
          + f" -> {args.output}")
    for line in warnings:
        print(f"pipeflow-profile: warning: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
