"""Receive buffers reused across microbatches (comm.P2P): a steady-state receive allocates nothing (issue 15)."""
from __future__ import annotations

import torch


class BufferPool:
    """Free receive buffers by (shape, dtype). A buffer comes back (release) once the backward of its
    microbatch has run: no graph holds it then, and no send does unless an output aliases it (`keep`)."""

    LIMIT = 64  # per shape: a schedule holds at most its in-flight microbatches' buffers

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self.reused = 0  # buffers served from the pool, for tests and logs

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        free = self.free.get((tuple(shape), dtype))
        if free:
            self.reused += 1
            return free.pop()
        return torch.empty(shape, dtype=dtype, device=self.device)

    def release(self, bufs: list[torch.Tensor], keep: list[torch.Tensor] | None = None) -> None:
        """Buffers no graph or pending send needs any more go back. One sharing memory with a tensor of `keep`
        (an output that passed a received tensor through, maybe still being sent) is left to the allocator."""
        held = {t.untyped_storage().data_ptr() for t in keep or [] if isinstance(t, torch.Tensor)}
        for b in bufs:
            if b.untyped_storage().data_ptr() in held or b.grad_fn is not None:
                continue
            b.requires_grad_(False)
            b.grad = None
            free = self.free.setdefault((tuple(b.shape), b.dtype), [])
            if len(free) < self.LIMIT:
                free.append(b)
