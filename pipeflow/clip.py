"""Gradient clipping by the global L2 norm (`--clip-grad-norm MAX`): across the pipeline, what one process does with
torch.nn.utils.clip_grad_norm_(model.parameters(), MAX) right before optimizer.step() (DeepSpeed's
gradient_clipping, Megatron-LM's clip_grad).

The norm is that of the step's final gradient: accumulated over the m microbatches, summed over the replicas and over
a tied parameter's stages (reduce.py). Each parameter counts on one rank: among its stage's replicas on the one
shard.owners gives it (with --shard-optimizer, the parameters that replica's optimizer updates; without, the same
split of the work), and a tied one on the first stage holding it only. Each rank's sum of squares reaches every rank
in one all-gather of a float64 per STEP, launched when the gradient is final and never read on the host; every rank
sums the same vector the same way (bit for bit the same norm everywhere) and multiplies the gradients its optimizer
reads by torch's coefficient min(MAX / (norm + 1e-6), 1), a device tensor.

A non-finite norm is handled as the step gate (guard.StepGuard) handles a non-finite gradient. The gate still checks
this rank's own gradients before they are scaled, so its messages name the stage the value came from; another
stage's NaN or inf reaches this rank through the norm: where the gate arms the optimizer to skip on the device (GPUs,
fused optimizers) the norm's flag joins that skip; where the ranks agree at every STEP (the flush schedules) such a
step was already skipped or stopped on every rank, and finite gradients whose squares overflow get torch's
coefficient, 0; elsewhere (2bw) the norm is read on the host and the update skipped.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeflow.comm import World, all_gather
from pipeflow.hooks import arm_device_skip
from pipeflow.kinds import ScheduleKind
from pipeflow.links import tied_here
from pipeflow.reduce import Tie
from pipeflow.shard import owners
from pipeflow.stage import Stage
from pipeflow.tensorops import applied, by_dtype

log = logging.getLogger(__name__)

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: MAX / (norm + EPS)


def square_sum(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of `grads`: a float64 0-d tensor on `device`, not read. One
    multi-tensor norm per dtype, as torch's clip_grad_norm_ takes them; of a sparse gradient its coalesced values."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for same in by_dtype(applied(g) for g in grads).values():
        norms = torch.stack(torch._foreach_norm(same)).to(device=device, dtype=torch.float64)
        total = total + norms.square().sum()
    return total


def scale_(grads: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient by the 0-d tensor `coef` in place, on the device: one multi-tensor multiply per dtype
    (`coef` in that dtype, as torch's is in the gradients'), a sparse gradient alone."""
    for (dev, dtype), same in by_dtype(grads).items():
        c = coef.to(device=dev, dtype=dtype)
        dense = [g for g in same if not g.is_sparse]
        if dense:
            torch._foreach_mul_(dense, c)
        for g in same:
            if g.is_sparse:
                g.mul_(c)


@dataclass
class Norm:
    """One step's global norm in flight: every rank's sum of squares, in rank order, once `work` completes."""

    shares: torch.Tensor
    work: Any  # None in a world of one


class GradClip:
    """One rank's part: `launch` when a step's gradient is final, `scale` just before the update that applies it (a
    STEP later where the update waits, update.py)."""

    def __init__(self, max_norm: float, counted: list[nn.Parameter], device: torch.device, world_size: int, *,
                 agreed: bool) -> None:
        self.max_norm, self.counted, self.device, self.size = max_norm, counted, device, world_size
        self.agreed = agreed  # the ranks agree at every STEP whether to apply it (guard.StepGuard, flush schedules)
        self.last_norm: torch.Tensor | None = None  # the last scaled gradient's norm, on the device: read at reports
        if world_size > 1:
            # NCCL makes a group's communicator at its first collective, the host waiting for every rank: at set-up,
            # where they all are, rather than at a first STEP that 2bw's stages reach at different times.
            self.launch().work.wait()

    def launch(self) -> Norm:
        """This rank's sum of squares of the gradients its counted parameters hold now, sent to every rank."""
        mine = square_sum([p.grad for p in self.counted if p.grad is not None], self.device).reshape(1)
        if self.size == 1:
            return Norm(mine, None)
        shares = torch.empty(self.size, dtype=torch.float64, device=self.device)
        return Norm(shares, all_gather(shares, mine))

    def scale(self, norm: Norm, grads: Sequence[torch.Tensor], optimizer: Any) -> bool:
        """Multiply `grads` (those `optimizer` reads) by torch's coefficient for the global `norm`. Returns whether
        the update may run: False where the norm is not finite and nothing else keeps the update from applying it
        (module docstring)."""
        if norm.work is not None:
            norm.work.wait()  # on a GPU the stream waits, not the host
        total = norm.shares.sum().sqrt()
        self.last_norm = total
        scale_(grads, (self.max_norm / (total + EPS)).clamp(max=1.0))
        bad = ~total.isfinite()
        found = getattr(optimizer, "found_inf", None)
        if found is not None:  # the gate armed the optimizer to skip on the device: the norm's flag joins it
            arm_device_skip(optimizer, torch.maximum(found, bad.to(found.dtype)))
            return True
        return self.agreed or not bool(bad)  # the one host read: CPUs, or a gate that read its own flags already


def grad_clip(max_norm: float | None, params: list[nn.Parameter], ties: list[Tie], stages: dict[int, Stage],
              replicas: int, replica: int, world: World, kind: ScheduleKind) -> GradClip | None:
    """--clip-grad-norm on a rank holding `params` of model `stages`, replica `replica` of `replicas`, under schedule
    `kind` (None without it): the parameters whose squares it counts (module docstring)."""
    if max_norm is None:
        return None
    if kind.step_per_backward:  # set-up refuses it first (config.check_clip_grad_norm)
        raise ValueError(f"clipping by the global norm needs one update per minibatch; {kind.name} updates per "
                         "microbatch")
    elsewhere = {id(p) for t, p in tied_here(ties, list(stages.values())) if t.stages[0] not in stages}
    trainable = [p for p in params if p.requires_grad]  # shard.ShardedUpdate's list, so the same owners
    owner = owners([p.numel() * p.element_size() for p in trainable], replicas)
    counted = [p for p, q in zip(trainable, owner) if q == replica and id(p) not in elsewhere]
    log.info("gradients clipped to a global L2 norm of at most %g: this rank counts %d of its %d parameter tensors",
             max_norm, len(counted), len(trainable))
    return GradClip(max_norm, counted, world.device, world.size, agreed=kind.agree_every_step)
