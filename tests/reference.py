"""Single-process training that pipeflow's distributed runs must equal (docs/reproducibility.md, What a run equals)."""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from pipeflow.data.loader import MicrobatchLoader
from pipeflow.spec import build_model


def make_optimizer(name: str, params: Any, lr: float, momentum: float = 0.0) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=lr)


def warmup_decay(lr: float, *, warmup: int, decay: str, min_lr: float = 0.0,
                 decay_steps: int | None = None) -> Callable[[int], float]:
    """u -> the lr of update u, written here apart from pipeflow/lrsched.py after nanoGPT's get_lr: linear warm-up
    lr (u + 1) / (N + 1) below N, then cosine or linear decay from lr at N to min_lr at K, min_lr beyond."""
    def f(u: int) -> float:
        if u < warmup:
            return lr * (u + 1) / (warmup + 1)
        if decay == "none":
            return lr
        assert decay_steps is not None
        if u >= decay_steps:
            return min_lr
        progress = (u - warmup) / (decay_steps - warmup)
        shape = (math.cos(math.pi * progress) + 1) / 2 if decay == "cosine" else 1 - progress
        return min_lr + shape * (lr - min_lr)
    return f


def seed_of(seed: int, t: int, i: int) -> int:
    """docs/reproducibility.md, written here apart from pipeflow: the seed of layer i on microbatch t
    is a splitmix64 chain over (seed, t, i), as a 63-bit number."""
    word = 2**64

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) % word
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = ((z ^ (z >> shift)) * mult) % word
        return z ^ (z >> 31)

    h = seed % word
    for v in (None, t, i):
        h = mix(h if v is None else h ^ (v % word))
    return h // 2


def _remembered(train: Callable[..., dict[str, torch.Tensor]]) -> Callable[..., dict[str, torch.Tensor]]:
    """A reference trained once per session for its arguments: tests of several schedules, splits or launches compare
    with the same run (44% of the suite's reference time was repeats). A call with `lr_at` (a function) trains anew;
    `norms`, an output, gets what the first call appended; each caller gets its own copy of the weights."""
    runs: dict[str, tuple[dict[str, torch.Tensor], list[float]]] = {}

    @functools.wraps(train)
    def remembered(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        if kwargs.get("lr_at") is not None:
            return train(*args, **kwargs)
        norms = kwargs.pop("norms", None)
        key = repr((args, sorted(kwargs.items())))
        if key not in runs:
            appended: list[float] = []
            runs[key] = (train(*args, norms=appended, **kwargs), appended)
        state, appended = runs[key]
        if norms is not None:
            norms.extend(appended)
        return {k: v.clone() for k, v in state.items()}
    return remembered


@_remembered
def reference_flush(model: str, model_args: dict[str, Any], *, steps: int, microbatches: int,
                    microbatch_size: int, optimizer: str = "sgd", lr: float = 0.05, momentum: float = 0.0,
                    seed: int = 0, dtype: torch.dtype = torch.float64, clip: float | None = None,
                    norms: list[float] | None = None,
                    lr_at: Callable[[int], float] | None = None) -> dict[str, torch.Tensor]:
    """gpipe / 1f1b semantics: per step, the mean of m microbatch losses, one optimizer step. Layer i runs
    on global microbatch t after torch.manual_seed(seed_of(seed, t, i)) (dropout; Reproducibility).
    `clip`: torch.nn.utils.clip_grad_norm_(model.parameters(), clip) before each step, its norm appended to `norms`.
    `lr_at`: step k at lr_at(k), as torch's LambdaLR(opt, lambda k: lr_at(k) / lr) stepped after each step sets it."""
    spec = build_model(model, model_args, seed=seed)
    net = nn.Sequential(*spec.layers).to(dtype)
    opt = make_optimizer(optimizer, net.parameters(), lr, momentum)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_at(k) / lr) if lr_at is not None else None
    loader = MicrobatchLoader(spec.dataset, microbatch_size, seed=seed)
    for k in range(steps):
        opt.zero_grad()
        for i in range(microbatches):
            t = k * microbatches + i
            x, y = loader.microbatch(t)
            h = x.to(dtype) if x.is_floating_point() else x
            for layer_index, layer in enumerate(net):
                torch.manual_seed(seed_of(seed, t, layer_index))
                h = layer(h)
            (spec.loss_fn(h, y) / microbatches).backward()
        if clip is not None:
            norm = float(nn.utils.clip_grad_norm_(net.parameters(), clip))
            if norms is not None:
                norms.append(norm)
        opt.step()
        if schedule is not None:
            schedule.step()
    return {k: v.detach() for k, v in net.state_dict().items()}


def args_json(d: dict[str, Any]) -> str:
    return json.dumps(d)


def weight_versions(schedule: str, replicas: list[int], *, minibatch: int,
                    vertical_sync: bool = False) -> list[Callable[[int], int]]:
    """Per stage, t -> the weight version microbatch t uses (docs/schedules.md; stash.py's docstring).

    async: stage s uses the version current at its forward in 1F1B(-RR), max(0, t // r_s - w_s) with
    w_s = ceil(sum(r[s:]) / r_s) - 1 warm-up forwards (no replicas: max(0, t - n + j), j = s + 1);
    vertical sync: the updates built from the microbatches stage 0 had applied, c = r_0 * v_0(t),
    i.e. version c // r_s. 2bw: minibatch k = t // m uses max(0, k - 1) everywhere."""
    n = len(replicas)
    if schedule == "2bw":
        return [lambda t: max(0, t // minibatch - 1) for _ in range(n)]
    warm = [math.ceil(sum(replicas[s:]) / replicas[s]) - 1 for s in range(n)]

    def latest(s: int, t: int) -> int:
        return max(0, t // replicas[s] - warm[s])

    if vertical_sync:
        return [lambda t, s=s: replicas[0] * latest(0, t) // replicas[s] for s in range(n)]
    return [lambda t, s=s: latest(s, t) for s in range(n)]


@_remembered
def reference_delayed(model: str, model_args: dict[str, Any], *, schedule: str, stages: list[tuple[int, int]],
                      steps: int, microbatches: int, microbatch_size: int, optimizer: str = "sgd",
                      lr: float = 0.05, momentum: float = 0.0, vertical_sync: bool = False, seed: int = 0,
                      dtype: torch.dtype = torch.float64, segment: int | None = None, clip: float | None = None,
                      norms: list[float] | None = None,
                      lr_at: Callable[[int], float] | None = None) -> dict[str, torch.Tensor]:
    """async / 2bw semantics, one microbatch at a time: microbatch t runs forward and backward through
    every stage s with version v_s(t) of its weights; stage s's update u (u + 1 updates in all) takes
    the gradients of microbatches [u U_s, (u + 1) U_s) and is applied to its latest weights: for async
    U_s = replicas of s and their mean (loss scale 1; PipeDream's replicas are DDP), for 2bw U_s = m and
    their sum (loss scale 1/m: the minibatch mean).
    `stages` is [(layer count, replicas)]. `segment` (microbatches, a multiple of m): the run drains every
    `segment` microbatches (checkpoint boundaries, stash.py "Segments"): at each segment start the current
    weights become version 0 and t counts from there.
    `clip` (2bw, where every stage updates at once): each update's gradient, over all stages, clipped by
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip) before it is applied, its norm appended to `norms`.
    `lr_at`: an update at lr_at(k), k the minibatch of its first microbatch (2bw: the update's own index; async: the
    same k for every update of minibatch k on every stage), whenever in the run it comes."""
    assert clip is None or schedule == "2bw", "async has no update of every stage at once to clip"
    spec = build_model(model, model_args, seed=seed)
    net = nn.Sequential(*spec.layers).to(dtype)
    bounds = [sum(c for c, _ in stages[:s]) for s in range(len(stages) + 1)]
    mods = [net[bounds[s]:bounds[s + 1]] for s in range(len(stages))]
    reps = [r for _, r in stages]
    version = weight_versions(schedule, reps, minibatch=microbatches, vertical_sync=vertical_sync)
    per_update = reps if schedule == "async" else [microbatches] * len(stages)
    scale = 1.0 if schedule == "async" else 1.0 / microbatches
    opts = [make_optimizer(optimizer, list(mod.parameters()), lr, momentum) if any(True for _ in mod.parameters())
            else None for mod in mods]  # a stage of activations only has nothing to update
    history = [[{k: v.detach().clone() for k, v in mod.named_parameters()}] for mod in mods]
    pending: list[dict[str, torch.Tensor]] = [{} for _ in mods]
    trains = [{k: p.requires_grad for k, p in mod.named_parameters()} for mod in mods]  # frozen: False
    loader = MicrobatchLoader(spec.dataset, microbatch_size, seed=seed)
    seg_start = 0
    for t in range(steps * microbatches):
        if segment and t and t % segment == 0:
            assert all(not p for p in pending), "a segment must end on an update of every stage"
            seg_start = t
            history = [[{k: v.detach().clone() for k, v in mod.named_parameters()}] for mod in mods]
        x, y = loader.microbatch(t)
        x = tree_map(lambda v: v.to(dtype) if v.is_floating_point() else v, x)  # a dict input's floats too
        used = []
        for s, mod in enumerate(mods):
            w = {k: v.detach().requires_grad_(trains[s][k]) for k, v in history[s][version[s](t - seg_start)].items()}
            used.append(w)
            x = torch.func.functional_call(mod, w, (x,))
        (spec.loss_fn(x, y) * scale).backward()
        for s in range(len(mods)):
            for k, v in used[s].items():
                if v.grad is not None:  # a parameter no microbatch of an update reached keeps no gradient
                    pending[s][k] = pending[s][k] + v.grad if k in pending[s] else v.grad
        due = [s for s in range(len(mods)) if (t + 1) % per_update[s] == 0]
        for s in due:
            for k, p in mods[s].named_parameters():
                g = pending[s].pop(k, None)
                if g is not None and schedule == "async":
                    g = g / per_update[s]
                p.grad = g if p.requires_grad else None  # frozen or without a gradient: stays (AdamW's decay too)
        if clip is not None and due:
            norm = float(nn.utils.clip_grad_norm_(net.parameters(), clip))
            if norms is not None:
                norms.append(norm)
        for s in due:
            if opts[s] is not None:
                for group in opts[s].param_groups:
                    group["lr"] = lr_at((t + 1 - per_update[s]) // microbatches) if lr_at is not None else lr
                opts[s].step()
                opts[s].zero_grad()
            history[s].append({k: v.detach().clone() for k, v in mods[s].named_parameters()})
    return {k: v.detach() for k, v in net.state_dict().items()}
