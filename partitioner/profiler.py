"""`pipeflow-profile`: time every layer's forward and backward and measure its output, saved-activation and
parameter bytes on a device (PipeDream SOSP'19 §3.1: the profile the partitioner plans from)."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from partitioner.profile import LayerProfile, Profile, ProfileError
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.spec import ModelError, ModelSpec, build_model, parse_model_args

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def tensors(x: Any) -> Iterator[torch.Tensor]:
    """The tensors of a layer's input or output (a tensor or a nested tuple/list of tensors)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for item in x:
            yield from tensors(item)


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(item, fn) for item in x)
    return x


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _Timer:
    """Milliseconds of a callable: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return float(start.elapsed_time(end))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def _prepare_input(x: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Detached copies on the device; floating ones in the profiling dtype and requiring grad, as a
    stage's received activations are."""
    def prep(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(device)
        if t.is_floating_point():
            t = t.to(dtype).requires_grad_(True)
        return t
    return _map(x, prep)


def _saved_bytes(layer: nn.Module, x: Any) -> int:
    """Bytes autograd keeps for this layer's backward: unique storages of the saved tensors, parameters
    excluded (the planner counts those separately)."""
    exclude = {_storage_key(p) for p in layer.parameters()}
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in exclude and key[0] != 0:
            seen[key] = key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(seen.values())


def _time_forward_backward(layer: nn.Module, x: Any, timer: _Timer) -> tuple[float, float]:
    """One forward, then backward from random output gradients (what the next stage would send)."""
    holder: dict[str, Any] = {}

    def forward() -> None:
        holder["y"] = layer(x)

    t_f = timer(forward)
    ys = [t for t in tensors(holder["y"]) if t.requires_grad]
    grads = [torch.randn_like(t) for t in ys]
    t_b = timer(lambda: torch.autograd.backward(ys, grads) if ys else None)
    layer.zero_grad(set_to_none=True)
    return t_f, t_b


def profile_layer(layer: nn.Module, x: Any, *, device: torch.device, dtype: torch.dtype, warmup: int,
                  repeats: int) -> tuple[dict[str, Any], Any]:
    """Measure one layer on input `x`; returns its numbers and its (detached) output for the next layer."""
    timer = _Timer(device)
    x = _prepare_input(x, device, dtype)
    with torch.no_grad():
        out = layer(x)
    outs = list(tensors(out))
    if not outs:
        raise ProfileError(f"layer {type(layer).__name__} returned {type(out).__name__}: expected a tensor or a "
                           "tuple of tensors")
    output_bytes = sum(t.numel() * t.element_size() for t in outs)
    parameter_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    activation_bytes = _saved_bytes(layer, x)

    fwd: list[float] = []
    bwd: list[float] = []
    for it in range(warmup + repeats):
        t_f, t_b = _time_forward_backward(layer, x, timer)
        if it >= warmup:
            fwd.append(t_f)
            bwd.append(t_b)
    stats = {"name": type(layer).__name__, "forward_ms": statistics.median(fwd),
             "backward_ms": statistics.median(bwd), "output_bytes": output_bytes,
             "activation_bytes": activation_bytes, "parameter_bytes": parameter_bytes}
    return stats, out


def profile_model(spec: ModelSpec, microbatch_size: int, device: str | torch.device = "cpu", *,
                  dtype: str = "float32", warmup: int = 2, repeats: int = 5, seed: int = 0) -> Profile:
    """Profile every layer of `spec` on one real microbatch of its dataset, in order (in-process API)."""
    if dtype not in DTYPES:
        raise ProfileError(f"--dtype must be one of {', '.join(DTYPES)}, found {dtype!r}")
    if warmup < 0 or repeats < 1:
        raise ProfileError(f"need --warmup >= 0 and --repeats >= 1, found {warmup} and {repeats}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("--device cuda, but torch sees no CUDA device; use --device cpu")
    torch_dtype = DTYPES[dtype]
    x, _ = MicrobatchLoader(spec.dataset, microbatch_size, seed=seed).microbatch(0)
    layers = []
    for i, layer in enumerate(spec.layers):
        layer.to(device=dev, dtype=torch_dtype)
        layer.train()
        stats, x = profile_layer(layer, x, device=dev, dtype=torch_dtype, warmup=warmup, repeats=repeats)
        stats["name"] = f"{i}:{stats['name']}"
        layers.append(stats)
    return Profile(spec.name or "model", dict(spec.args), dev.type, dtype, microbatch_size,
                   [LayerProfile(**s) for s in layers])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipeflow-profile", description=__doc__)
    p.add_argument("--model", required=True, help="gpt, mlp or package.module:function")
    p.add_argument("--model-args", default=None, help="JSON object of keyword arguments for the model builder")
    p.add_argument("--microbatch-size", type=int, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True, help="profile.json to write")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.microbatch_size < 1:
            raise ProfileError(f"--microbatch-size must be >= 1, found {args.microbatch_size}")
        model_args = parse_model_args(args.model_args)
        try:
            spec = build_model(args.model, model_args, seed=args.seed)
        except (ValueError, TypeError) as e:
            if isinstance(e, ModelError):
                raise
            raise ModelError(f"cannot build model {args.model!r} with --model-args {model_args}: {e}") from None
        prof = profile_model(spec, args.microbatch_size, args.device, dtype=args.dtype, warmup=args.warmup,
                             repeats=args.repeats, seed=args.seed)
        prof.save(args.output)
    except (ModelError, ProfileError, OSError) as e:
        print(f"pipeflow-profile: error: {e}", file=sys.stderr)
        return 2
    total_f = sum(layer.forward_ms for layer in prof.layers)
    total_b = sum(layer.backward_ms for layer in prof.layers)
    print(f"profiled {len(prof.layers)} layers of {prof.model} on {prof.device} ({prof.dtype}, microbatch "
          f"{prof.microbatch_size}): forward {total_f:.3f} ms, backward {total_b:.3f} ms -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
