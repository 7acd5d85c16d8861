"""Replays a schedule's action lists on per-stage costs: step time, bubble fraction, peak memory (pure).

What the replay charges, as the runtime does it (pipeflow/comm.py, pipeflow/reduce.py):
- compute (F, B) runs on its worker in list order, waiting for the message it consumes;
- links: each worker has one send port and one receive port (full duplex). A message occupies the sender's
  send port and the receiver's receive port for bytes / bandwidth of the lowest topology level that holds
  both, so all transfers through a worker share its bandwidth (three replicas feeding one worker queue at
  its receive port), and reaches the receiver StageCost.latency_ms later (calibrated; 0 by default). Sends
  are non-blocking: they overlap compute. The transfer starts with the sender's own time for the message
  (StageCost.message_ms, calibrated: the end of the F or B that sends it), so the receiver has it after the longer
  of the two, not their sum (on CPU gloo writes the message in that time). Ports serve messages in time order;
- STEP: the replicas' ring all-reduce (2 (r-1)/r * P / B per topology level) is bucketed into the last
  backward, so it starts when every replica has started its last backward and ends no earlier than it
  ends (`reduce_late`: launched when every replica is at the STEP, waited for at the next); then the local
  optimizer step.
Actions are processed in time order (an event loop over workers), so port bookings are in time order too.
"""
from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from partitioner.topology import Topology
from pipeflow.actions import Kind, Schedule, ScheduleError
from pipeflow.kinds import ScheduleKind, schedule_kind
from pipeflow.schedule import add_communication, compute_orders

OPTIMIZER_STATES = {"sgd": 1, "adam": 2, "adamw": 2}


@dataclass
class StageCost:
    """One stage, per microbatch: compute, the transfer to the next stage (each direction, one message),
    the all-reduce and optimizer step at STEP, and the bytes it holds. `output_bytes` with a topology
    (see simulate) replaces `send_ms` by bytes / bandwidth of each sender-receiver pair."""

    forward_ms: float
    backward_ms: float
    send_ms: float = 0.0
    allreduce_ms: float = 0.0
    parameter_bytes: float = 0.0
    activation_bytes: float = 0.0
    optimizer_ms: float = 0.0
    output_bytes: float = 0.0
    weight_ms: float = 0.0  # the W share of backward_ms, run apart where the schedule splits the backward
    latency_ms: float = 0.0  # each message's delay beyond bytes / bandwidth, after which the receiver has it
    message_ms: float = 0.0  # the sender's own time per message, the end of the F (B) that sends it: the
    # transfer starts with it (a send the calling thread writes, gloo's, holds the transfer in that time)
    transient_bytes: float = 0.0  # held on top of the in-flight activations at the peak (the loss's on the last stage;
    # under CUDA graphs every replayed action's static input and output, partitioner/price.py)
    state_share: float = 1.0  # the share of the stage's optimizer state a replica holds (1/r: --shard-optimizer)
    reduce_late: bool = False  # its all-reduce launched at a STEP, completed at the next (2bw's deferred update)
    frozen_bytes: float = 0.0  # parameters without gradient or optimizer state (parameter_bytes: the trainable ones)
    buffer_bytes: float = 0.0  # buffers, held once


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


class _Schedule(Schedule):
    """A Schedule whose worker tables are computed once (Schedule rebuilds them on every call)."""

    @functools.cached_property
    def workers(self) -> list[tuple[int, int]]:
        return super().workers

    @functools.cached_property
    def _stage_of(self) -> list[int]:
        return [s for s, _ in self.workers]

    def stage_of(self, worker: int) -> int:
        return self._stage_of[worker]


def build(name: str, stages: int, microbatches: int, replicas: Sequence[int], *,
          minibatch: int | None = None, virtual_stages: int = 1, warmup: Sequence[int] | None = None) -> Schedule:
    """The generated schedule, as pipeflow.schedule.generate builds it, without its validation and dry run
    (the generators are tested; the replay below detects a deadlock itself). `stages` counts rank groups;
    `warmup` (1f1b, 2bw): forwards before the first backward per rank group, None for the schedule's minimum."""
    sched = _Schedule(name, stages, microbatches, tuple(replicas), virtual_stages=virtual_stages)
    sched.actions = add_communication(sched, compute_orders(sched, minibatch=minibatch, warmup=warmup))
    return sched


def replay(sched: Schedule, stages: Sequence[StageCost], *, ranks: Sequence[Sequence[int]] | None = None,
           topology: Topology | None = None, keep_timeline: bool = False
           ) -> tuple[float, list[float], list[Interval], list[int]]:
    """Times every action (see the module docstring). Returns the makespan, busy compute ms per worker,
    the intervals (with keep_timeline) and the peak in-flight microbatches per worker. `stages` holds one
    cost per model stage; a rank group holding several (interleaved) steps them all at its STEP."""
    S, reps, K = sched.stages, sched.replicas, sched.model_stages
    stage_of = [s for s in range(S) for _ in range(reps[s])]
    base = [sum(reps[:s]) for s in range(S + 1)]
    n = len(stage_of)
    msg = _Messages(stages, stage_of, base, ranks, topology)
    acts = sched.actions
    chunks = [range(g, K, S) for g in range(S)]
    allreduce_ms = [sum(stages[k].allreduce_ms for k in ks) for ks in chunks]
    late = [any(stages[k].reduce_late for k in ks) for ks in chunks]
    reduced = [0.0] * S  # late: when the all-reduce a group's last STEP launched completes
    optimizer_ms = [sum(stages[k].optimizer_ms for k in ks) for ks in chunks]
    # A split backward (zero bubble): B costs backward - W, W the rest; activations live until W, and W
    # is the last backward the replicas' all-reduce overlaps.
    split = any(a.kind is Kind.W for x in acts for a in x)
    release = Kind.W if split else Kind.B
    pos, clock = [0] * n, [0.0] * n
    send_free, recv_free = [0.0] * n, [0.0] * n
    arrival: dict[tuple[int, Kind, int, int], float] = {}  # (receiver, F|B, its stage, microbatch) -> when
    parked: dict[tuple[int, Kind, int, int], int] = {}  # a message awaited -> the worker waiting for it
    busy, live, peak = [0.0] * n, [0] * n, [0] * n
    steps = [0] * n
    last_b = [0.0] * n  # start of the worker's latest backward
    last: list[tuple[Kind, int | None, int] | None] = [None] * n  # the worker's latest F, B or W (kind, mb, stage)
    step_in: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
    step_end: dict[tuple[int, int], float] = {}
    intervals: list[Interval] = []
    heap = [(0.0, w) for w in range(n)]
    while heap:
        now, w = heapq.heappop(heap)
        g, mine = stage_of[w], acts[w]
        while pos[w] < len(mine):
            a = mine[pos[w]]
            kind, i = a.kind, a.microbatch
            s = g if a.stage is None else a.stage  # the model stage it runs on
            cost = stages[s]
            if kind is Kind.F or kind is Kind.B or kind is Kind.W:
                start = clock[w]
                if (kind is Kind.F and s > 0) or (kind is Kind.B and s < K - 1):
                    key: tuple[int, Kind, int, int] = (w, kind, s, i or 0)
                    got = arrival.get(key)
                    if got is None:
                        parked[key] = w
                        break
                    if got > start:
                        start = got
                if start > now:  # resume in time order
                    clock[w] = start
                    heapq.heappush(heap, (start, w))
                    break
                dur = (cost.forward_ms if kind is Kind.F else cost.weight_ms if kind is Kind.W
                       else cost.backward_ms - cost.weight_ms if split else cost.backward_ms)
                clock[w] = start + dur
                last[w] = (kind, i, s)
                busy[w] += dur
                if kind is Kind.F:
                    live[w] += 1
                    peak[w] = max(peak[w], live[w])
                elif kind is release:
                    live[w] -= 1
                    last_b[w] = start
                if keep_timeline:
                    intervals.append(Interval(w, kind, i, start, start + dur))
                pos[w] += 1
                if dur > 0:
                    heapq.heappush(heap, (clock[w], w))
                    break
                continue
            if kind is Kind.SEND_F or kind is Kind.SEND_B:
                assert i is not None
                t = s + 1 if kind is Kind.SEND_F else s - 1
                peer = base[t % S] + i % reps[t % S]  # stage t runs on group t mod S
                d = msg(w, peer, min(s, t))
                made = (Kind.F if kind is Kind.SEND_F else Kind.B, i, s)  # the action whose end sends it
                sent = cost.message_ms if last[w] == made else 0.0
                t0 = max(clock[w] - sent, send_free[w], recv_free[peer])
                send_free[w] = recv_free[peer] = t0 + d
                key = (peer, kind.direction, t, i)
                # latency: off the ports; never before the sender is done with it
                arrival[key] = got_at = max(t0 + d, clock[w]) + stages[min(s, t)].latency_ms
                if key in parked:
                    del parked[key]
                    heapq.heappush(heap, (max(clock[peer], got_at), peer))
            elif kind is Kind.STEP:
                group = (g, steps[w])
                start = clock[w]
                if reps[g] > 1:
                    if group not in step_end:
                        step_in.setdefault(group, {})[w] = (clock[w], last_b[w])
                        if len(step_in[group]) < reps[g]:
                            break  # parked until the last replica arrives
                        arrived = step_in.pop(group)
                        ready = max(r for r, _ in arrived.values())
                        step_end[group] = max(ready, reduced[g] if late[g] else
                                              max(b for _, b in arrived.values()) + allreduce_ms[g])
                        reduced[g] = ready + allreduce_ms[g]
                        for other in arrived:
                            if other != w:
                                heapq.heappush(heap, (step_end[group], other))
                    clock[w] = max(clock[w], step_end[group])
                clock[w] += optimizer_ms[g]
                if keep_timeline:
                    intervals.append(Interval(w, "STEP", None, start, clock[w]))
                steps[w] += 1
                pos[w] += 1
                if clock[w] > now:
                    heapq.heappush(heap, (clock[w], w))
                    break
                continue
            # RECV_*: posting a receive costs nothing; the compute waits for the data.
            pos[w] += 1
    stuck = {w: p for w, p in enumerate(pos) if p < len(acts[w])}
    if stuck:
        what = ", ".join(f"worker {w} at {acts[w][p]}" for w, p in stuck.items())
        raise ScheduleError(f"deadlock: {what} can never proceed\n{sched.render(stuck)}")
    return max(clock, default=0.0), busy, intervals, peak


class _Messages:
    """ms of one message between two workers across the boundary after stage s, computed on first use (a
    gradient is as large as the activation it belongs to): only pairs that exchange microbatches are asked."""

    def __init__(self, stages: Sequence[StageCost], stage_of: Sequence[int], base: Sequence[int],
                 ranks: Sequence[Sequence[int]] | None, topology: Topology | None) -> None:
        self.stages, self.stage_of, self.base, self.ranks, self.topology = stages, stage_of, base, ranks, topology
        self.cache: dict[tuple[int, int, int], float] = {}

    def __call__(self, a: int, b: int, s: int) -> float:
        got = self.cache.get((a, b, s))
        if got is None:
            sa, sb = self.stage_of[a], self.stage_of[b]
            if self.ranks is not None and self.topology is not None:
                ra, rb = self.ranks[sa][a - self.base[sa]], self.ranks[sb][b - self.base[sb]]
                level = self.topology.level_of(ra, rb)
                got = self.stages[s].output_bytes / (self.topology.levels[level].bandwidth / 1e3)
            else:
                got = self.stages[s].send_ms
            self.cache[(a, b, s)] = got
        return got


def _stage_peaks(sched: Schedule, stages: Sequence[StageCost], peak: list[int], kind: ScheduleKind,
                 optimizer: str) -> tuple[list[float], list[int]]:
    """Per model stage: the peak bytes and in-flight microbatches of its rank group. A group holding several
    chunks (interleaved) counts all their weights, and its in-flight (chunk, microbatch) pairs at the
    largest of its chunks' activations."""
    mem, fl = [], []
    S = sched.stages
    stage_of = [s for s in range(S) for _ in range(sched.replicas[s])]
    for s in range(len(stages)):
        n = max(peak[w] for w in range(len(stage_of)) if stage_of[w] == s % S)
        mine = stages[s % S::S]
        # Copies of the weights beside the live ones, as stash.py holds them (ScheduleKind.stashed_versions).
        weights = sum((c.parameter_bytes + c.frozen_bytes) * (1 + kind.stashed_versions(n, c.state_share))
                      + c.parameter_bytes * (1 + OPTIMIZER_STATES[optimizer] * c.state_share) + c.buffer_bytes
                      for c in mine)
        mem.append(weights + n * max(c.activation_bytes for c in mine) + max(c.transient_bytes for c in mine))
        fl.append(n)
    return mem, fl


def simulate(schedule: str, stages: Sequence[StageCost], replicas: Sequence[int] | None = None,
             microbatches: int = 1, *, optimizer: str = "adam", keep_timeline: bool = False,
             ranks: Sequence[Sequence[int]] | None = None, topology: Topology | None = None,
             virtual_stages: int = 1, warmup: Sequence[int] | None = None) -> SimResult:
    """Step time, bubble and memory of `schedule` over the stages. gpipe / 1f1b: one flushed minibatch.
    async / 2bw run without flush: the steady state is the difference of two runs, k and k+2 minibatches
    long, with k large enough to fill the pipeline. With `ranks` (per stage, per replica) and `topology`,
    each message takes StageCost.output_bytes at the bandwidth of the level joining its two ranks.
    `virtual_stages` v: the stages are S*v chunks, stage k on rank group k mod S (interleaved). `warmup`
    (1f1b, 2bw): forwards before the first backward per rank group (None: the schedule's minimum)."""
    groups = len(stages) // virtual_stages
    reps = tuple(replicas or (1,) * len(stages))[:groups]
    n_workers = sum(reps)
    m = microbatches
    kw = {"ranks": ranks, "topology": topology}
    kind = schedule_kind(schedule)
    if kind.flush:
        sched = build(schedule, groups, m, reps, virtual_stages=virtual_stages, warmup=warmup)
        t, busy, iv, peak = replay(sched, stages, keep_timeline=keep_timeline, **kw)  # type: ignore[arg-type]
        step, compute = t, sum(busy)
    else:
        k1 = max(2, math.ceil(2 * n_workers / m))
        runs = []
        for k in (k1, k1 + 2):
            sched = build(schedule, len(stages), k * m, reps, minibatch=m, warmup=warmup)
            runs.append(replay(sched, stages, keep_timeline=keep_timeline and k > k1, **kw))  # type: ignore[arg-type]
        (t1, b1, _, _), (t2, b2, iv, peak) = runs
        step, compute = (t2 - t1) / 2, (sum(b2) - sum(b1)) / 2
    bubble = 1.0 - compute / (n_workers * step) if step > 0 else 0.0
    mem, fl = _stage_peaks(sched, stages, peak, kind, optimizer)
    return SimResult(step, max(0.0, bubble), mem, fl, sched, iv)
