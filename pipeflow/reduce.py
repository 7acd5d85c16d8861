"""Gradient all-reduce among a stage's replicas, bucketed and started during the last backward
(Poseidon ATC'17, wait-free backpropagation): a bucket goes out as soon as all its gradients are final."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class GradReducer:
    """Sums gradients over `group`. Buckets follow reverse parameter order (the order backward finishes
    them) and are launched strictly in index order, so every replica issues the same collectives."""

    def __init__(self, params: list[nn.Parameter], group: Any, *, bucket_bytes: int = 25 << 20) -> None:
        self.group = group
        self.buckets: list[list[nn.Parameter]] = []
        size = bucket_bytes + 1
        for p in reversed([p for p in params if p.requires_grad]):
            if size > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: b for b, ps in enumerate(self.buckets) for p in ps}
        self.ready = [0] * len(self.buckets)
        self.next = 0
        self.works: list[tuple[Any, torch.Tensor, int]] = []
        self.armed = False
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        """The next backward is this replica's last of the step: reduce as gradients become final."""
        self.armed = True
        self.ready = [0] * len(self.buckets)
        self.next = 0

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        b = self.bucket_of[p]  # type: ignore[index]
        self.ready[b] += 1
        while self.next < len(self.buckets) and self.ready[self.next] == len(self.buckets[self.next]):
            self._launch(self.next)
            self.next += 1

    def _launch(self, b: int) -> None:
        ps = self.buckets[b]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
        self.works.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, b))

    def finish(self) -> None:
        """Launch what backward did not (unused parameters), wait, and write the sums back."""
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1
        for work, flat, b in self.works:
            work.wait()
            offset = 0
            for p in self.buckets[b]:
                n = p.numel()
                chunk = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
                offset += n
        self.works.clear()
        self.armed = False
