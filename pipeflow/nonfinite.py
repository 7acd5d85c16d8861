"""The non-finite check of an update's gradients, on the device without reading it (guard.StepGuard runs it at
every STEP; pipeflow-profile times it with the optimizer step, as part of what an update costs)."""
from __future__ import annotations

from collections.abc import Iterable

import torch


def nonfinite_flag(grads: Iterable[torch.Tensor], device: torch.device,
                   ones: dict[tuple[torch.device, torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
    """float32 1. on `device` where a gradient holds NaN or inf, else 0., not read: one multi-tensor kernel per
    gradient dtype (AMP's non-finite check, unscaling by exactly 1); bfloat16, which that kernel does not take
    on CUDA, by max-norms (NaN kept); other dtypes (complex) per tensor. `ones`: a cache of the scale tensors."""
    ones = {} if ones is None else ones
    found = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (gdev, dtype), same in groups.items():
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
