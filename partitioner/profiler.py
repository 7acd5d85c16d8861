"""`pipeflow-profile`: time every layer's forward and backward and measure its output, saved-activation and
parameter bytes on a device (PipeDream SOSP'19 §3.1: the profile the partitioner plans from)."""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from partitioner.profile import LayerProfile, Profile, ProfileError
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.spec import ModelError, ModelSpec, build_model, model_dtype, parse_model_args
from pipeflow.split import time_split_backward

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _not_sequence(x: Any) -> bool:
    """Pytree leaves here: everything but tuples and lists (a layer's data is a tensor or nested tuples/lists)."""
    return not isinstance(x, (tuple, list))


def tensors(x: Any) -> Iterator[torch.Tensor]:
    """The tensors of a layer's input or output (a tensor or a nested tuple/list of tensors), in order."""
    return (t for t in tree_leaves(x, is_leaf=_not_sequence) if isinstance(t, torch.Tensor))


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`x` with `fn` applied to each of its tensors; its tuples, lists and other values kept."""
    return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, x, is_leaf=_not_sequence)


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


def _prepare_input(x: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Detached copies on the device; floating ones (in `dtype` if given) requiring grad, as a stage's
    received activations are."""
    def prep(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(device)
        if t.is_floating_point():
            t = (t if dtype is None else t.to(dtype)).requires_grad_(True)
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


def profile_layer(layer: nn.Module, x: Any, *, device: torch.device, dtype: torch.dtype | None, warmup: int,
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
    split = time_split_backward(layer, x, timer, warmup=warmup, repeats=repeats)  # zero bubble: B and W apart
    if split is not None and sum(split) > 0:  # W's share of the (fused) backward
        stats["backward_weight_ms"] = statistics.median(bwd) * split[1] / sum(split)
    return stats, out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sandbox_copy(layer: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """A private copy of `layer` to measure, in train mode on the device (torchgpipe's training_sandbox):
    the user's layer keeps its parameters, buffers (BatchNorm statistics), device, dtype and mode."""
    return copy.deepcopy(layer).to(device=device, dtype=dtype).train()


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _machine_bytes(device: torch.device) -> tuple[int, str]:
    """Memory a microbatch must fit in: the GPU's on cuda, the host's RAM otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"GPU {device}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(x))


def _check_microbatch_fits(spec: ModelSpec, microbatch_size: int, device: torch.device,
                           dtype: torch.dtype | None, seed: int) -> None:
    """Refuse, before collating it, a microbatch that cannot fit (issue 11). Rule: measured on a probe of
    min(b, 2) samples and scaled linearly to b, (1) the microbatch's input and target must fit in host RAM
    and (2) the largest layer's input + output + saved activations must fit in the device's memory."""
    n = min(microbatch_size, 2)
    x, y = MicrobatchLoader(spec.dataset, n, seed=seed).microbatch(0)
    host = (_nbytes(x) + _nbytes(y)) * microbatch_size // n
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if host > ram:
        raise ProfileError(f"--microbatch-size {microbatch_size} cannot work: its input and target take about "
                           f"{host / 2**30:.1f} GiB ({(host * n // microbatch_size)} bytes per {n} samples) but "
                           f"this machine has {ram / 2**30:.1f} GiB of RAM; use a smaller --microbatch-size")
    need = 0
    x = _cast_floats_to(x, dtype)
    for layer in spec.layers:
        work = _sandbox_copy(layer, device, dtype)
        x = _prepare_input(x, device, None)
        with torch.no_grad():
            out = work(x)
        need = max(need, _nbytes(x) + _nbytes(out) + _saved_bytes(work, x))
        x = _map(out, lambda t: t.detach())
        del work
    _free(device)
    need = need * microbatch_size // n
    room, where = _machine_bytes(device)
    if need > room:
        raise ProfileError(f"--microbatch-size {microbatch_size} cannot work: one layer needs about "
                           f"{need / 2**30:.1f} GiB for its input, output and saved activations (measured on {n} "
                           f"samples, scaled) but {where} has {room / 2**30:.1f} GiB; use a smaller "
                           "--microbatch-size")


def _cast_floats_to(x: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return x
    return _map(x, lambda t: t.to(dtype) if t.is_floating_point() else t)


def profile_model(spec: ModelSpec, microbatch_size: int, device: str | torch.device = "cpu", *,
                  dtype: str | None = None, warmup: int = 2, repeats: int = 5, seed: int = 0) -> Profile:
    """Profile every layer of `spec` on one real microbatch of its dataset, in order (in-process API).

    `dtype` None profiles in the model's own dtype, as pipeflow-train runs it without --dtype; floating
    inputs are cast to the dtype of the first floating-point parameter (pipeflow.stage.model_dtype).
    Each layer is measured on a deep copy, freed after, with the global CPU and CUDA generators saved and
    restored: the user's layers and RNG are left exactly as they were."""
    if dtype is not None and dtype not in DTYPES:
        raise ProfileError(f"--dtype must be one of {', '.join(DTYPES)}, found {dtype!r}")
    if warmup < 0 or repeats < 1:
        raise ProfileError(f"need --warmup >= 0 and --repeats >= 1, found {warmup} and {repeats}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("--device cuda, but torch sees no CUDA device; use --device cpu")
    torch_dtype = DTYPES[dtype] if dtype is not None else None
    model = nn.ModuleList(spec.layers)
    in_dtype = torch_dtype or model_dtype(model)
    name = dtype or _dtype_name(in_dtype or torch.float32)
    cuda_devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    layers = []
    with torch.random.fork_rng(devices=cuda_devices):  # restores the CPU and this GPU's generators
        _check_microbatch_fits(spec, microbatch_size, dev, in_dtype, seed)
        x, _ = MicrobatchLoader(spec.dataset, microbatch_size, seed=seed).microbatch(0)
        x = _cast_floats_to(x, in_dtype)
        for i, layer in enumerate(spec.layers):
            work = _sandbox_copy(layer, dev, torch_dtype)
            stats, x = profile_layer(work, x, device=dev, dtype=None, warmup=warmup, repeats=repeats)
            del work
            _free(dev)
            stats["name"] = f"{i}:{stats['name']}"
            layers.append(stats)
    return Profile(spec.name or "model", dict(spec.args), dev.type, name, microbatch_size,
                   [LayerProfile(**s) for s in layers])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipeflow-profile", description=__doc__)
    p.add_argument("--model", required=True, help="gpt, mlp or package.module:function")
    p.add_argument("--model-args", default=None, help="JSON object of keyword arguments for the model builder")
    p.add_argument("--microbatch-size", type=int, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="cast the layers to this dtype (default: the dtype the model's builder gave it)")
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
