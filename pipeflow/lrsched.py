"""Learning-rate schedule: linear warm-up, then cosine or linear decay to a floor (`--lr-warmup`, `--lr-decay`,
`--min-lr`, `--lr-decay-steps`): nanoGPT's train.py get_lr, Megatron-LM's --lr-warmup-iters / --lr-decay-style /
--min-lr, DeepSpeed's WarmupDecayLR.

For update u (0-based), peak lr, warm-up N, decay end K and floor min_lr:

    u < N        lr * (u + 1) / (N + 1)
    N <= u <= K  min_lr + c(r) * (lr - min_lr),  r = (u - N) / (K - N),  c = (1 + cos(pi r)) / 2 (cosine) or 1 - r
    u > K        min_lr                            (decay none: lr from u = N on)

The optimizer steps with each param group's lr set to this value just before update u, as torch's
LambdaLR(opt, lambda u: f(u) / lr) stepped after each optimizer.step() would give it. u counts updates made, skipped
ones included (Megatron's schedule is a function of the iteration), from the run's step 0 across resumes; which
update is u under each schedule is `ScheduledLr`'s business (docs/schedules.md, Learning-rate schedule).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

DECAYS = ("none", "cosine", "linear")
NAMES = {k: f"LrSchedule.{k}" for k in ("warmup", "decay", "min_lr", "decay_steps")}  # the API's spelling


def lr_at(u: int, *, lr: float, warmup: int = 0, decay: str = "none", min_lr: float = 0.0,
          decay_steps: int | None = None) -> float:
    """The learning rate of update `u` (module docstring); `decay_steps` (K) is needed when decaying."""
    if u < warmup:
        return lr * (u + 1) / (warmup + 1)
    if decay == "none":
        return lr
    assert decay_steps is not None and decay_steps > warmup, (decay_steps, warmup)
    if u > decay_steps:
        return min_lr
    r = (u - warmup) / (decay_steps - warmup)
    coef = 0.5 * (1.0 + math.cos(math.pi * r)) if decay == "cosine" else 1.0 - r
    return min_lr + coef * (lr - min_lr)


def check(*, warmup: int, decay: str, min_lr: float, decay_steps: int | None, lr: float | None = None,
          steps: int | None = None, names: Mapping[str, str] = NAMES) -> None:
    """ValueError in one line for settings the schedule cannot follow, each named as `names` spells it (flags or
    fields). `lr`: the peak, where one is known; `steps`: what decay_steps defaults to (pipeflow-train's --steps)."""
    if warmup < 0:
        raise ValueError(f"{names['warmup']} must be >= 0 updates, found {warmup}")
    if decay not in DECAYS:
        raise ValueError(f"{names['decay']} must be one of {', '.join(DECAYS)}, found {decay!r}")
    if not (math.isfinite(min_lr) and min_lr >= 0) or (lr is not None and min_lr > lr):
        top, peak = (f" <= {names['lr']}", f" and {names['lr']} {lr}") if lr is not None else ("", "")
        raise ValueError(f"{names['min_lr']} must be a finite number with 0 <= {names['min_lr']}{top} (the floor the "
                         f"decay reaches), found {names['min_lr']} {min_lr}{peak}")
    if decay_steps is not None and decay_steps < 1:
        raise ValueError(f"{names['decay_steps']} must be >= 1 update, found {decay_steps}")
    if decay == "none":
        unused = [names[k] for k, v in (("min_lr", min_lr), ("decay_steps", decay_steps)) if v]
        if unused:
            raise ValueError(f"{' and '.join(unused)} {'need' if len(unused) > 1 else 'needs'} a decay "
                             f"({names['decay']} cosine or linear), found {names['decay']} none")
        return
    end = decay_steps if decay_steps is not None else steps
    default = f" (default: {names['steps']})" if "steps" in names else ""
    if end is None:
        raise ValueError(f"{names['decay']} {decay} needs {names['decay_steps']}, the update at which the decay "
                         f"reaches {names['min_lr']}; found none")
    if end <= warmup:
        found = (f"{names['decay_steps']} {decay_steps}" if decay_steps is not None
                 else f"{names['steps']} {steps}")
        raise ValueError(f"{names['decay']} {decay} needs {names['decay_steps']}{default} > {names['warmup']}, the "
                         f"decay running from the warm-up's end to that update; found {found} and {names['warmup']} "
                         f"{warmup}")


@dataclass(frozen=True)
class LrSchedule:
    """The schedule's settings (pipeflow-train's --lr-warmup, --lr-decay, --min-lr, --lr-decay-steps; the Python
    API's Pipeline(lr_schedule=...)). The peak is each param group's lr as the optimizer factory set it."""

    warmup: int = 0
    decay: str = "none"
    min_lr: float = 0.0
    decay_steps: int | None = None  # K: the update at which the decay reaches min_lr

    def __post_init__(self) -> None:
        check(warmup=self.warmup, decay=self.decay, min_lr=self.min_lr, decay_steps=self.decay_steps)

    def describe(self) -> str:
        """One line for the log: the warm-up and the decay."""
        parts = [f"linear warm-up over {self.warmup} updates"] if self.warmup else []
        if self.decay != "none":
            parts.append(f"{self.decay} decay to {self.min_lr:g} at update {self.decay_steps}")
        return ", then ".join(parts) or "constant"

    def lr(self, u: int, peak: float) -> float:
        return lr_at(u, lr=peak, warmup=self.warmup, decay=self.decay, min_lr=self.min_lr,
                     decay_steps=self.decay_steps)


class ScheduledLr:
    """One rank's optimizer under an LrSchedule. Update u is the one that applies the gradient of minibatch u
    (flush schedules, 2bw: the u-th STEP's gradient, whenever it is applied, update.py); under async, where a
    stage updates after every `per_update` microbatches (its replicas'), that of the minibatch its update's first
    microbatch belongs to, so every stage follows the same curve in steps, as PipeDream sets its lr by the
    progress through the data. `begin(step)` where a run, step or segment starts at minibatch `step`; `take()` at
    each STEP, the index of the gradient it makes; `set(u)` just before the update applying that gradient."""

    def __init__(self, schedule: LrSchedule, optimizer: torch.optim.Optimizer, *, per_update: int,
                 microbatches: int) -> None:
        self.schedule, self.optimizer = schedule, optimizer
        self.per, self.m = per_update, microbatches
        self.peaks = [float(g["lr"]) for g in optimizer.param_groups]  # before any checkpoint's groups load
        low = [(i, p) for i, p in enumerate(self.peaks) if p < schedule.min_lr]
        if low:
            raise ValueError(f"LrSchedule.min_lr {schedule.min_lr} is above param group {low[0][0]}'s lr "
                             f"{low[0][1]}, the peak the optimizer factory gave it: the decay would raise it")
        self.made = 0  # this rank's gradients made from the run's start: STEPs of the run so far

    def begin(self, step: int) -> None:
        self.made = step * self.m // self.per  # a segment starts on an update boundary of every stage

    def take(self) -> int:
        u = self.made * self.per // self.m
        self.made += 1
        return u

    def at(self, u: int, group: int = 0) -> float:
        return self.schedule.lr(u, self.peaks[group])

    def set(self, u: int) -> None:
        """Each group's lr for update u: a Python float (a fused step reads it without a device sync), or written
        into a tensor lr in place (capturable optimizers keep theirs on the device)."""
        for g, peak in zip(self.optimizer.param_groups, self.peaks):
            value = self.schedule.lr(u, peak)
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(value)
            else:
                g["lr"] = value


def scheduled_lr(schedule: LrSchedule | None, optimizer: torch.optim.Optimizer, *, per_update: int,
                 microbatches: int) -> ScheduledLr | None:
    """A rank's ScheduledLr, or None without a schedule (its optimizer keeps the lr its factory gave)."""
    if schedule is None:
        return None
    return ScheduledLr(schedule, optimizer, per_update=per_update, microbatches=microbatches)
