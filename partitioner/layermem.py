"""What a layer keeps for its backward, and whether a microbatch can fit at all (pipeflow-profile measures
both on a private copy of each layer before timing anything)."""
from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from partitioner.measure import cast_floats_to, free_cached, machine_bytes, map_tensors, nbytes, prepare_input, tensors
from partitioner.profile import ProfileError
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.received import received
from pipeflow.spec import ModelSpec
from pipeflow.split import WeightGradStore, install


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def saved_bytes(layer: nn.Module, x: Any) -> int:
    """Bytes autograd keeps for this layer's backward: unique storages of the saved tensors, parameters and
    buffers excluded (the planner counts those once per stage)."""
    return saved_parts(layer, x)[0]


def saved_parts(layer: nn.Module, x: Any) -> tuple[int, int, int]:
    """saved_bytes, and how much of it is the layer's input and how much its output: a stage holds its received
    input and its sent output until the microbatch's backward (pipeflow/stage.py), so the planner adds what of
    them the layers at its ends do not save (LayerCosts.boundary_bytes)."""
    held = {_storage_key(t) for t in (*layer.parameters(), *layer.buffers())}
    seen: dict[tuple[int, int], int] = {}
    out = _saved(lambda: layer(received(x)), held, seen)
    ends = [sum(seen.get(k, 0) for k in {_storage_key(t) for t in tensors(v)}) for v in (x, out)]
    return sum(seen.values()), ends[0], ends[1]


def loss_bytes(loss_fn: Callable[[Any, Any], torch.Tensor], output: Any, target: Any,
               device: torch.device) -> tuple[int, int]:
    """Memory the loss takes beyond the last layer's output, from its forward to the end of its backward, on top
    of what the last stage holds (profile.json `loss_bytes`), and what of it the loss's backward keeps from its
    forward on (`loss_saved_bytes`: held per microbatch in flight, all of them under gpipe). On CUDA the first is the
    allocator's peak over that window (the GPT's fp32 logits, log-softmax and their gradients: about 12 bytes per
    logit); elsewhere what the loss saves for its backward and the gradient of its input, a lower bound (temporaries
    are not seen)."""
    x = prepare_input(output, device, None)
    given = {_storage_key(t) for t in (*tensors(x), *tensors(target))}  # the stage holds these anyway
    kept = _saved(lambda: loss_fn(x, target), given)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss_fn(x, target).backward()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base, kept), kept
    return kept + nbytes(x), kept


def _saved(run: Callable[[], Any], exclude: set[tuple[int, int]], seen: dict[tuple[int, int], int] | None = None
           ) -> Any:
    """Unique storages of the tensors autograd saves while `run()` builds its graph, those in `exclude` aside: their
    bytes, or with `seen` given, what `run()` returned, `seen` filled with each storage's bytes."""
    given = seen is not None
    seen = {} if seen is None else seen
    alive: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> tuple[int, int]:
        key = _storage_key(t)
        if key not in exclude and key[0] != 0:
            seen[key] = key[1]
        # Its storage stays alive until the measurement ends, as the graph would keep it: otherwise a saved
        # intermediate is freed at once, the next tensor of its size takes its address and the two count once
        # (on a GPU, whose caching allocator hands a freed block straight back: a GPT block (d 2048) measured
        # 448.6 MiB at microbatch 8, 14 of the 16 activation-sized tensors it saves, as counted on CPU).
        # Detached: the storage without the graph, so no path back to the nodes that save it.
        alive.append(t.detach())
        # The key, not the tensor, goes into the graph: a graph holding its own output through a pack hook is a
        # reference cycle through C++ that Python's collector cannot free, and planning on the spot kept every
        # layer's activations on rank 0's GPU for the whole run (7.5 GiB on the GPT of benchmarks/gpu at
        # microbatch 8).
        return key

    def unpack(key: tuple[int, int]) -> torch.Tensor:
        raise RuntimeError("saved_bytes only measures: its graph is never run backward")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = run()
    return out if given else sum(seen.values())


def sandbox_copy(layer: nn.Module, device: torch.device, dtype: torch.dtype | None, *,
                 fuse: bool = False) -> nn.Module:
    """A private copy of `layer` to measure, in train mode on the device (torchgpipe's training_sandbox):
    the user's layer keeps its parameters, buffers (BatchNorm statistics), device, dtype and mode. `fuse`: its
    nn.Linear layers add weight gradients into .grad inside their GEMM, as a stage's do (pipeflow/split.py)."""
    work = copy.deepcopy(layer).to(device=device, dtype=dtype).train()
    if fuse:
        install(work, WeightGradStore(fuse=True))
    return work


def check_microbatch_fits(spec: ModelSpec, microbatch_size: int, device: torch.device,
                           dtype: torch.dtype | None, seed: int, *, inputs: torch.dtype | None = None) -> None:
    """Refuse, before collating it, a microbatch that cannot fit (issue 11). Rule: measured on a probe of
    min(b, 2) samples and scaled linearly to b, (1) the microbatch's input and target must fit in host RAM
    and (2) the largest layer's input + output + saved activations must fit in the device's memory. `dtype`
    (--dtype) casts the layers, None keeps each its own (a float32 layer inside a float64 model stays float32);
    `inputs` (default `dtype`) the microbatch's floating tensors."""
    n = min(microbatch_size, 2)
    x, y = MicrobatchLoader(spec.dataset, n, seed=seed).microbatch(0)
    host = (nbytes(x) + nbytes(y)) * microbatch_size // n
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if host > ram:
        raise ProfileError(f"--microbatch-size {microbatch_size} cannot work: its input and target take about "
                           f"{host / 2**30:.1f} GiB ({(host * n // microbatch_size)} bytes per {n} samples) but "
                           f"this machine has {ram / 2**30:.1f} GiB of RAM; use a smaller --microbatch-size")
    need = 0
    x = cast_floats_to(x, dtype if inputs is None else inputs)
    for layer in spec.layers:
        work = sandbox_copy(layer, device, dtype)
        x = prepare_input(x, device, None)
        with torch.no_grad():
            out = work(x)
        need = max(need, nbytes(x) + nbytes(out) + saved_bytes(work, x))
        x = map_tensors(out, lambda t: t.detach())
        del work
    free_cached(device)
    need = need * microbatch_size // n
    room, where = machine_bytes(device)
    if need > room:
        raise ProfileError(f"--microbatch-size {microbatch_size} cannot work: one layer needs about "
                           f"{need / 2**30:.1f} GiB for its input, output and saved activations (measured on {n} "
                           f"samples, scaled) but {where} has {room / 2**30:.1f} GiB; use a smaller "
                           "--microbatch-size")
