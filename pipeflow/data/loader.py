"""Deterministic microbatches: step k takes m*b consecutive samples of one seeded permutation."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import Dataset


def collate(items: list[Any]) -> Any:
    """Stack a list of samples; tuples and lists are stacked element-wise."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(items)
    if isinstance(first, (tuple, list)):
        return tuple(collate([it[k] for it in items]) for k in range(len(first)))
    if isinstance(first, (int, float)):
        return torch.tensor(items)
    raise TypeError(f"cannot batch samples of type {type(first).__name__}; expected tensors or tuples of tensors")


class MicrobatchLoader:
    """Sample order: torch.randperm(len, seed) (or 0..len-1 with shuffle=False), cycled over epochs.
    Microbatch j overall (j = step*m + i) is samples [j*b, (j+1)*b) of that order."""

    def __init__(self, dataset: Dataset, microbatch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        if n < 1:
            raise ValueError("the dataset is empty")
        if microbatch_size < 1:
            raise ValueError(f"--microbatch-size must be >= 1, found {microbatch_size}")
        self.dataset = dataset
        self.b = microbatch_size
        self.order = (torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if shuffle
                      else torch.arange(n))

    def indices(self, j: int) -> list[int]:
        n = len(self.order)
        return [int(self.order[(j * self.b + k) % n]) for k in range(self.b)]

    def signature(self, j: int) -> tuple[tuple[int, ...], ...]:
        """The input shapes of microbatch j, from one sample: every rank can compute it without the
        data travelling, so shapes between stages need to be exchanged only when it changes."""
        x = self.dataset[self.indices(j)[0]][0]
        return tuple((self.b, *t.shape) for t in _tensors(x))

    def microbatch(self, j: int) -> tuple[Any, Any]:
        """(input, target) of the j-th microbatch since the start of training."""
        inputs, targets = collate([self.dataset[i] for i in self.indices(j)])
        return inputs, targets


def _tensors(x: Any) -> list[torch.Tensor]:
    """A sample's tensors in order (a tensor or nested tuples/lists of them); a number counts as a 0-d tensor."""
    return [torch.as_tensor(v) for v in tree_leaves(x, is_leaf=lambda v: not isinstance(v, (tuple, list)))]
