"""Replays a schedule's action lists on per-stage costs: step time, bubble fraction, peak memory (pure)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeflow.schedule import Schedule, dependencies, dry_run, generate

OPTIMIZER_STATES = {"sgd": 1, "adam": 2, "adamw": 2}


@dataclass
class StageCost:
    """One stage, per microbatch: compute, the transfer to the next stage (each direction, one message),
    the all-reduce at STEP, and the bytes it holds."""

    forward_ms: float
    backward_ms: float
    send_ms: float = 0.0
    allreduce_ms: float = 0.0
    parameter_bytes: float = 0.0
    activation_bytes: float = 0.0


@dataclass
class Interval:
    worker: int
    kind: str  # F, B, W, STEP (all-reduce + optimizer)
    microbatch: int | None
    start: float
    end: float


@dataclass
class SimResult:
    step_ms: float  # time per minibatch of m microbatches (steady state for async / 2bw)
    bubble_fraction: float  # share of worker time not spent computing
    peak_memory_bytes: list[float]  # per stage, max over its replicas
    peak_in_flight: list[int]  # per stage: most microbatches whose activations are held at once
    schedule: Schedule
    timeline: list[Interval] = field(default_factory=list)


def replay(sched: Schedule, stages: Sequence[StageCost]) -> tuple[float, list[float], list[Interval], list[int]]:
    """Times every action: a compute waits for the worker's previous action and the message it consumes;
    a SEND occupies its (src, dst) link for send_ms, messages in posting order (non-blocking, overlapped);
    a STEP starts when all replicas reach it and lasts the stage's all-reduce.
    Returns makespan, busy compute ms per worker, the intervals, peak in-flight per worker."""
    deps = dependencies(sched)
    order = dry_run(sched)  # a valid global order; deadlocks raise with the grid
    end: list[list[float]] = [[0.0] * len(acts) for acts in sched.actions]
    arrival: dict[tuple[int, int], float] = {}
    link_free: dict[tuple[int, int], float] = {}
    busy = [0.0] * len(sched.actions)
    intervals: list[Interval] = []
    live = [0] * len(sched.actions)
    peak = [0] * len(sched.actions)
    for w, idx in order:
        a = sched.actions[w][idx]
        s = sched.stage_of(w)
        cost = stages[s]
        ready = end[w][idx - 1] if idx else 0.0
        if a.kind in ("F", "B", "W"):
            start = max([ready] + [arrival[d] for d in deps[w][idx]])
            dur = cost.forward_ms if a.kind == "F" else (cost.backward_ms if a.kind == "B" else 0.0)
            end[w][idx] = start + dur
            busy[w] += dur
            intervals.append(Interval(w, a.kind, a.microbatch, start, start + dur))
            if a.kind == "F":
                live[w] += 1
                peak[w] = max(peak[w], live[w])
            elif a.kind == "B":
                live[w] -= 1
        elif a.kind in ("SEND_F", "SEND_B"):
            peer = sched.peer(w, a)
            ms = cost.send_ms if a.kind == "SEND_F" else stages[s - 1].send_ms
            t0 = max(ready, link_free.get((w, peer), 0.0))
            link_free[(w, peer)] = t0 + ms
            arrival[(w, idx)] = t0 + ms
            end[w][idx] = ready
        elif a.kind == "STEP":
            start = max([ready] + [end[o][i] for o, i in deps[w][idx]])
            ar = cost.allreduce_ms if sched.replicas[s] > 1 else 0.0
            end[w][idx] = start + ar
            intervals.append(Interval(w, "STEP", None, start, start + ar))
        else:  # RECV_*: posting a receive costs nothing; the compute waits for the data
            end[w][idx] = ready
    makespan = max((e[-1] for e in end if e), default=0.0)
    return makespan, busy, intervals, peak


def _stage_peaks(sched: Schedule, stages: Sequence[StageCost], peak: list[int], schedule: str,
                 optimizer: str) -> tuple[list[float], list[int]]:
    mem, fl = [], []
    for s, cost in enumerate(stages):
        n = max(peak[w] for w in range(len(sched.workers)) if sched.stage_of(w) == s)
        # Weight stashing (PipeDream §3.3): a version per in-flight microbatch; 2BW: two versions.
        versions = n if schedule == "async" else (1 if schedule == "2bw" else 0)
        weights = cost.parameter_bytes * (2 + OPTIMIZER_STATES[optimizer] + versions)
        mem.append(weights + n * cost.activation_bytes)
        fl.append(n)
    return mem, fl


def simulate(schedule: str, stages: Sequence[StageCost], replicas: Sequence[int] | None = None,
             microbatches: int = 1, *, optimizer: str = "adam", keep_timeline: bool = False) -> SimResult:
    """Step time, bubble and memory of `schedule` over the stages. gpipe / 1f1b: one flushed minibatch.
    async / 2bw run without flush: the steady state is the difference of two runs, k and k+2 minibatches
    long, with k large enough to fill the pipeline."""
    reps = tuple(replicas or (1,) * len(stages))
    n_workers = sum(reps)
    m = microbatches
    if schedule in ("gpipe", "1f1b"):
        sched = generate(schedule, len(stages), m, reps)
        t, busy, iv, peak = replay(sched, stages)
        step, compute = t, sum(busy)
    else:
        k1 = max(2, math.ceil(2 * n_workers / m))
        runs = []
        for k in (k1, k1 + 2):
            sched = generate(schedule, len(stages), k * m, reps, minibatch=m)
            runs.append(replay(sched, stages))
        (t1, b1, _, _), (t2, b2, iv, peak) = runs
        step, compute = (t2 - t1) / 2, (sum(b2) - sum(b1)) / 2
    bubble = 1.0 - compute / (n_workers * step) if step > 0 else 0.0
    mem, fl = _stage_peaks(sched, stages, peak, schedule, optimizer)
    return SimResult(step, max(0.0, bubble), mem, fl, sched, iv if keep_timeline else [])
