"""Receive buffers reused across microbatches (comm.P2P): a steady-state receive allocates nothing (issue 15)."""
from __future__ import annotations

import torch

# The number of references to a storage (a private torch function). Without it no buffer is reused: a reused
# buffer that something still reads is a silent wrong result.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def shared(t: torch.Tensor) -> bool:
    """Whether another tensor shares `t`'s memory: a view or a detached alias that outlives the microbatch (a
    layer's kept input, as Transformer-XL keeps each layer's input as the next segment's memory; a gradient that
    autograd made of the received one without a copy: a sparse embedding's values, a parameter's gradient
    through a view). Two references are t's own and the storage object asked."""
    return _use_count is None or int(_use_count(t.untyped_storage()._cdata)) > 2


class BufferPool:
    """Free receive buffers by (shape, dtype). A buffer comes back (release) once the backward of its
    microbatch has run: no graph holds it then, and no send does unless an output aliases it (`keep`); one whose
    memory another tensor still shares (`shared`) is left to the allocator."""

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
            if b.untyped_storage().data_ptr() in held or b.grad_fn is not None or shared(b):
                continue
            b.requires_grad_(False)
            b.grad = None
            free = self.free.setdefault((tuple(b.shape), b.dtype), [])
            if len(free) < self.LIMIT:
                free.append(b)
