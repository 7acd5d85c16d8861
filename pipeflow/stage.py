"""One stage's layers: forward and backward per microbatch, keeping what backward needs in between."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeflow.comm import flatten


def to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        if device.type == "cuda" and x.device.type == "cpu":
            # Pinned memory makes the copy truly asynchronous: no host sync in the steady state.
            return x.pin_memory().to(device, non_blocking=True)
        return x.to(device, non_blocking=True)
    if isinstance(x, (tuple, list)):
        return tuple(to_device(v, device) for v in x)
    return x


@dataclass
class _Saved:
    inputs: list[torch.Tensor]   # received tensors that require grad (leaves of this stage's graph)
    outputs: list[torch.Tensor]  # outputs whose gradient comes back from downstream (or the loss)


class Stage:
    """Layers [start, end) of the model as one nn.Sequential (its state_dict keys are local indices)."""

    def __init__(self, layers: list[nn.Module], *, start: int, first: bool, last: bool,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.module = nn.Sequential(*layers).to(device=device, dtype=dtype)
        self.start = start
        self.first, self.last = first, last
        self.loss_fn = loss_fn
        self.device = device
        self.dtype = dtype
        self.saved: dict[int, _Saved] = {}

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def forward(self, mb: int, inputs: list[torch.Tensor] | Any, target: torch.Tensor | None = None,
                *, loss_scale: float = 1.0) -> list[torch.Tensor]:
        """Run the layers on one microbatch. A received input list is unpacked back into a tuple when
        the previous stage produced several tensors. On the last stage returns [loss] (detached, unscaled)."""
        if self.first:
            x = to_device(inputs, self.device)
            x = _cast_floats(x, self.dtype)
            leaves: list[torch.Tensor] = []
        else:
            leaves = [t for t in inputs if t.requires_grad]
            x = inputs[0] if len(inputs) == 1 else tuple(inputs)
        out = self.module(x)
        if self.last:
            if self.loss_fn is None or target is None:
                raise RuntimeError("the last stage needs a loss function and a target")
            loss = self.loss_fn(out, to_device(target, self.device))
            self.saved[mb] = _Saved(leaves, [loss * loss_scale])
            return [loss.detach()]
        outs = flatten(out)
        self.saved[mb] = _Saved(leaves, [t for t in outs if t.requires_grad])
        return outs

    def backward(self, mb: int, grads: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Backward of one microbatch; returns the gradients of the inputs that required grad."""
        saved = self.saved.pop(mb)
        if self.last:
            torch.autograd.backward(saved.outputs)
        elif saved.outputs:
            assert grads is not None and len(grads) == len(saved.outputs), "gradient count mismatch"
            torch.autograd.backward(saved.outputs, grads)
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in saved.inputs]


def mark_requires_grad(tensors: list[torch.Tensor], flags: list[bool]) -> list[torch.Tensor]:
    """Received tensors become leaves that require grad where the sender's did."""
    for t, f in zip(tensors, flags):
        if f:
            t.requires_grad_(True)
    return tensors


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, tuple):
        return tuple(_cast_floats(v, dtype) for v in x)
    return x
