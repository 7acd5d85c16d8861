"""A stage's received activations as its layers' input: the same memory, but not an autograd leaf.

A received activation must require grad (its gradient is what the stage sends back), and a tensor that requires
grad and was not computed here is a leaf, which no operation may change in place. In one process the same tensor is
the previous layer's output, so a first layer that changes its input in place (nn.ReLU(inplace=True), as in
torchvision's VGG and ResNet) works there and stopped a stage with "a leaf Variable that requires grad is being
used in an in-place operation". The layers get an alias made by an identity Function instead: no copy, its gradient
passed to the leaf unchanged, and autograd's own checks still catch an in-place change of a tensor a backward needs
(they share the version counter)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


class _Alias(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor) -> torch.Tensor:
        return leaf.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def received(x: Any) -> Any:
    """`x` (a tensor, or tuples, lists and dicts of them: structure.py) with each tensor that requires grad replaced
    by its alias; one tensor found in several places by one alias (a layer that returned (h, h): an in-place change
    through one is then recorded for both, as in one process)."""
    made: dict[int, torch.Tensor] = {}

    def alias(t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            return t
        if id(t) not in made:
            made[id(t)] = _Alias.apply(t)
        return made[id(t)]
    return alias(x) if isinstance(x, torch.Tensor) else tree_map(alias, x)
