"""What an update does on the device besides the optimizer step: the non-finite check of the gradients, without
reading it (guard.StepGuard runs it at every STEP), and the copy of a stage's weights that the asynchronous
schedules keep as a version (stash.py); pipeflow-profile times both, as part of what an update costs."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def applied(grad: torch.Tensor) -> torch.Tensor:
    """The values an optimizer applies: a sparse gradient's (nn.Embedding(sparse=True)) coalesced, its duplicate
    rows summed as the optimizer sums them; a dense one itself."""
    return grad.coalesce().values() if grad.is_sparse else grad


def by_dtype(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """`tensors` grouped by device and dtype, in order: what one multi-tensor kernel takes."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def nonfinite_flag(grads: Iterable[torch.Tensor], device: torch.device,
                   ones: dict[tuple[torch.device, torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
    """float32 1. on `device` where a gradient holds NaN or inf, else 0., not read: one multi-tensor kernel per
    gradient dtype (AMP's non-finite check, unscaling by exactly 1); bfloat16, which that kernel does not take
    on CUDA, by max-norms (NaN kept); other dtypes (complex) per tensor. `ones`: a cache of the scale tensors."""
    ones = {} if ones is None else ones
    found = torch.zeros((), dtype=torch.float32, device=device)
    for (gdev, dtype), same in by_dtype(applied(g) for g in grads).items():
        if dtype in (torch.float16, torch.float32, torch.float64):
            one = ones.get((gdev, dtype))
            if one is None:
                one = ones[(gdev, dtype)] = torch.ones((), dtype=torch.float32, device=gdev)
            hit = found if gdev == device else torch.zeros((), dtype=torch.float32, device=gdev)
            torch._amp_foreach_non_finite_check_and_unscale_(same, hit, one)  # x * 1 == x: grads unchanged
            if hit is not found:
                found = torch.maximum(found, hit.to(device))
        elif dtype.is_floating_point:
            bad = ~torch.stack(torch._foreach_norm(same, float("inf"))).isfinite().all()
            found = torch.maximum(found, bad.float().to(device))
        else:
            bad = ~torch.stack([g.isfinite().all() for g in same]).all()
            found = torch.maximum(found, bad.float().to(device))
    return found


# Tensors of at least this many elements are copied one by one: a plain copy of a large tensor runs at the
# memory's bandwidth, where the multi-tensor copy moved 1.38 GB of GPT stage-0 weights in 3.2 ms on an H200
# (0.86 TB/s, benchmarks/gpu/README.md); the small ones (biases, norms) share one multi-tensor launch.
LARGE = 1 << 20


def copy_weights(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i: the large tensors each by its own copy, the rest in one multi-tensor
    copy (one launch for many small tensors: at small microbatches the launches, not the bytes, cost)."""
    small_d, small_s = [], []
    for d, s in zip(dst, src, strict=True):
        if s.numel() >= LARGE:
            d.copy_(s)
        else:
            small_d.append(d)
            small_s.append(s)
    if small_d:
        torch._foreach_copy_(small_d, small_s)


def random_like(t: torch.Tensor) -> torch.Tensor:
    """Normal noise shaped like `t`, as a gradient the next stage might send (timing, the B/W split); drawn in
    float32 and cast where torch has no normal kernel for `t`'s dtype (float8 on a CPU)."""
    try:
        return torch.randn_like(t)
    except (RuntimeError, NotImplementedError):
        return torch.randn(t.shape, device=t.device).to(t.dtype)
