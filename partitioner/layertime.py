"""pipeflow-profile --timing idle and kernels: each layer timed by its own calls, one repeat after another
(--timing stage times them inside the chain a stage runs instead: partitioner/chain.py)."""
from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

from partitioner.layermem import saved_parts
from partitioner.measure import Timer, prepare_input, tensors
from partitioner.profile import ProfileError
from pipeflow.received import received
from pipeflow.split import time_split_backward
from pipeflow.structure import OutputError
from pipeflow.structure import split as sendable
from pipeflow.tensorops import random_like


def _time_forward_backward(layer: nn.Module, x: Any, timer: Timer, *, accumulate: bool) -> tuple[float, float]:
    """One forward, then backward from random output gradients (what the next stage would send); with
    `accumulate` into the gradients the parameters already hold, as every microbatch of a step but the first
    does (the input's gradient is fresh either way, as a received activation's is)."""
    if not accumulate:
        layer.zero_grad(set_to_none=True)
    for t in tensors(x):
        t.grad = None
    holder: dict[str, Any] = {}

    def forward() -> None:
        holder["y"] = layer(received(x))  # as a stage gets it: it may change it in place

    t_f = timer(forward)
    ys = [t for t in tensors(holder["y"]) if t.requires_grad]
    grads = [random_like(t) for t in ys]
    t_b = timer(lambda: torch.autograd.backward(ys, grads) if ys else None)
    return t_f, t_b


def profile_layer(layer: nn.Module, x: Any, *, device: torch.device, dtype: torch.dtype | None, warmup: int,
                  repeats: int, held: bool = False) -> tuple[dict[str, Any], Any]:
    """Measure one layer on input `x`; returns its numbers and its (detached) output for the next layer.
    `held`: on CUDA, time its kernels back to back (measure.Timer) instead of each call from an idle device."""
    timer = Timer(device, held=held)
    x = prepare_input(x, device, dtype)
    with torch.no_grad():
        out = layer(x)
    try:  # what a stage sends (pipeflow/structure.py: a tensor returned twice, once), refused before any plan is made
        outs, _ = sendable(out)
    except OutputError as e:
        raise ProfileError(f"layer {type(layer).__name__}: {e}") from None
    if not outs:
        raise ProfileError(f"layer {type(layer).__name__} returned {type(out).__name__}: expected a tensor or a "
                           "tuple of tensors")
    output_bytes = sum(t.numel() * t.element_size() for t in outs)
    parameter_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    activation_bytes, saved_input, saved_output = saved_parts(layer, x)

    fwd: list[float] = []
    bwd: list[float] = []
    acc: list[float] = []
    passes: list[float] = []  # forward + backward of each repeat, for the spread between repeats
    for it in range(warmup + repeats):
        t_f, t_b = _time_forward_backward(layer, x, timer, accumulate=False)
        t_f2, t_a = _time_forward_backward(layer, x, timer, accumulate=True)
        if it >= warmup:
            fwd += [t_f, t_f2]
            bwd.append(t_b)
            acc.append(t_a)
            passes.append(t_f + t_b)
    layer.zero_grad(set_to_none=True)
    stats = {"name": type(layer).__name__, "forward_ms": statistics.median(fwd),
             "backward_ms": statistics.median(bwd), "output_bytes": output_bytes,
             "activation_bytes": activation_bytes, "parameter_bytes": parameter_bytes,
             "frozen_bytes": sum(p.numel() * p.element_size() for p in layer.parameters() if not p.requires_grad),
             "buffer_bytes": sum(b.numel() * b.element_size() for b in layer.buffers()),
             "saved_input_bytes": saved_input, "saved_output_bytes": saved_output,
             "backward_accumulate_ms": statistics.median(acc), "_passes": passes}
    split = time_split_backward(layer, x, timer, warmup=warmup, repeats=repeats)  # zero bubble: B and W apart
    if split is not None and sum(split) > 0:  # W's share of the (fused) backward
        stats["backward_weight_ms"] = statistics.median(bwd) * split[1] / sum(split)
    return stats, out
