"""What a layer keeps for its backward, and whether a microbatch can fit at all (pipeflow-profile measures
both on a private copy of each layer before timing anything)."""
from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from partitioner.measure import cast_floats_to, free_cached, machine_bytes, map_tensors, nbytes, prepare_input
from partitioner.profile import ProfileError
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.spec import ModelSpec
from pipeflow.split import WeightGradStore, install


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def saved_bytes(layer: nn.Module, x: Any) -> int:
    """Bytes autograd keeps for this layer's backward: unique storages of the saved tensors, parameters
    excluded (the planner counts those separately)."""
    exclude = {_storage_key(p) for p in layer.parameters()}
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> tuple[int, int]:
        key = _storage_key(t)
        if key not in exclude and key[0] != 0:
            seen[key] = key[1]
        # Not the tensor: a graph holding its own output through a pack hook is a reference cycle through
        # C++ that Python's collector cannot free, and planning on the spot kept every layer's activations
        # on rank 0's GPU for the whole run (7.5 GiB on the GPT of benchmarks/gpu at microbatch 8).
        return key

    def unpack(key: tuple[int, int]) -> torch.Tensor:
        raise RuntimeError("saved_bytes only measures: its graph is never run backward")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        layer(x)
    return sum(seen.values())


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
                           dtype: torch.dtype | None, seed: int) -> None:
    """Refuse, before collating it, a microbatch that cannot fit (issue 11). Rule: measured on a probe of
    min(b, 2) samples and scaled linearly to b, (1) the microbatch's input and target must fit in host RAM
    and (2) the largest layer's input + output + saved activations must fit in the device's memory."""
    n = min(microbatch_size, 2)
    x, y = MicrobatchLoader(spec.dataset, n, seed=seed).microbatch(0)
    host = (nbytes(x) + nbytes(y)) * microbatch_size // n
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if host > ram:
        raise ProfileError(f"--microbatch-size {microbatch_size} cannot work: its input and target take about "
                           f"{host / 2**30:.1f} GiB ({(host * n // microbatch_size)} bytes per {n} samples) but "
                           f"this machine has {ram / 2**30:.1f} GiB of RAM; use a smaller --microbatch-size")
    need = 0
    x = cast_floats_to(x, dtype)
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
