"""Deterministic microbatches: step k takes m*b consecutive samples of one seeded permutation.

A dataset may draw random numbers in __getitem__ (noise, masks, crops). Every rank that needs a microbatch reads its
samples itself (the first stage the inputs, the last the targets), so the samples of microbatch j are read with
torch's CPU generator, numpy's and Python's seeded from (seed, j) first (seeds.layer_seed(seed, j, SAMPLES)): both
ranks see the same noisy sample, whatever the plan. As for dropout (stage.py), nothing is restored after: whatever
draws next seeds first (saving and restoring numpy's state cost 70 us a microbatch; seeding the three, 7 us)."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import Dataset

from pipeflow.seeds import SAMPLES, layer_seed


def collate(items: list[Any]) -> Any:
    """Stack a list of samples; tuples and lists are stacked element-wise, dicts key by key (the first sample's
    keys, in its order: a Hugging Face style {"input_ids": ..., "attention_mask": ...} input)."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(items)
    if isinstance(first, (tuple, list)):
        return tuple(collate([it[k] for it in items]) for k in range(len(first)))
    if isinstance(first, dict):
        keys = list(first)
        for it in items[1:]:
            if not isinstance(it, dict) or list(it) != keys:
                found = sorted(it) if isinstance(it, dict) else type(it).__name__
                raise TypeError(f"samples of one microbatch must have the same dict keys: expected {keys}, found "
                                f"{found}")
        return {k: collate([it[k] for it in items]) for k in keys}
    if isinstance(first, (int, float)):
        return torch.tensor(items)
    raise TypeError(f"cannot batch samples of type {type(first).__name__}; expected tensors or tuples or dicts of "
                    "tensors")


def seed_host_generators(seed: int) -> None:
    """torch's CPU generator, numpy's and Python's seeded with `seed` (not CUDA's: a sample is read on the host)."""
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


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
        self.b, self.seed = microbatch_size, seed
        # A Python list: indices() reads it at every microbatch, without a tensor element read per sample.
        self.order: list[int] = (torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if shuffle
                                 else torch.arange(n)).tolist()
        self.device: torch.device | None = None
        self.block = 1
        self._staged: dict[int, Any] = {}                      # block -> its samples, collated, on the device
        self._signatures: dict[int, tuple[tuple[int, ...], ...]] = {}

    def stage_on(self, device: torch.device, block: int) -> None:
        """Read microbatches `block` at a time (a minibatch): each block's samples are collated and moved to
        `device` in one copy per tensor, and microbatch() returns slices of it. The values are those of the
        per-microbatch path (stacking then slicing is stacking the slice); what changes is one host-to-device
        copy per step instead of one per microbatch and input (issue 15)."""
        if block < 1:
            raise ValueError(f"the staging block must be >= 1 microbatches, found {block}")
        self.device, self.block = device, block
        self._staged.clear()

    def indices(self, j: int) -> list[int]:
        n = len(self.order)
        return [self.order[(j * self.b + k) % n] for k in range(self.b)]

    def samples(self, j: int, first_only: bool = False) -> list[Any]:
        """The samples of microbatch j (or its first), read after seeding the generators for j (module docstring)."""
        seed_host_generators(layer_seed(self.seed, j, SAMPLES))
        return [self.dataset[i] for i in self.indices(j)[:1 if first_only else None]]

    def signature(self, j: int) -> tuple[tuple[int, ...], ...]:
        """The input shapes of microbatch j, from one sample: every rank can compute it without the
        data travelling, so shapes between stages need to be exchanged only when it changes."""
        sig = self._signatures.get(j)
        if sig is None:  # asked for at every send and receive: read the sample once
            if len(self._signatures) >= 4 * self.block + 64:
                self._signatures.clear()
            x = self.samples(j, first_only=True)[0][0]
            sig = self._signatures[j] = tuple((self.b, *t.shape) for t in _tensors(x))
        return sig

    def microbatch(self, j: int) -> tuple[Any, Any]:
        """(input, target) of the j-th microbatch since the start of training (on the staging device, if any)."""
        if self.device is None:
            inputs, targets = collate(self.samples(j))
            return inputs, targets
        k, i = divmod(j, self.block)
        staged = self._staged.get(k)
        if staged is None:
            if len(self._staged) >= 2:  # the previous block may still be read (replicas, segments); not older ones
                del self._staged[min(self._staged)]
            samples = [s for jj in range(k * self.block, (k + 1) * self.block) for s in self.samples(jj)]
            # collate gives tuples of tensors: pytree's own containers, no is_leaf needed
            staged = self._staged[k] = tree_map(lambda t: _to(t, self.device), collate(samples))
        lo, hi = i * self.b, (i + 1) * self.b
        inputs, targets = tree_map(lambda t: t[lo:hi] if isinstance(t, torch.Tensor) else t, staged)
        return inputs, targets


def _to(t: Any, device: torch.device | None) -> Any:
    if not isinstance(t, torch.Tensor) or device is None:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)  # pinned: the copy does not sync the host
    return t.to(device)


def batch_leaf(x: Any) -> bool:
    """Pytree leaves of a batch: everything but tuples, lists and dicts (a dict input is walked into)."""
    return not isinstance(x, (tuple, list, dict))


def _tensors(x: Any) -> list[torch.Tensor]:
    """A sample's tensors in order (a tensor or nested tuples, lists and dicts of them); a number counts as a 0-d
    tensor."""
    return [torch.as_tensor(v) for v in tree_leaves(x, is_leaf=batch_leaf)]
