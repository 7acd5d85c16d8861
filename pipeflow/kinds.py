"""The schedule kind table: one record per schedule holding every rule the runtime, the planner and the
simulator need (pure). No other module compares schedule names: they read `schedule_kind(name)`.

Generated compute orders for S=3 stages, m=4 microbatches::

    gpipe   s0: F0 F1 F2 F3 B0 B1 B2 B3 STEP      1f1b  s0: F0 F1 F2 B0 F3 B1 B2 B3 STEP
            s1: F0 F1 F2 F3 B0 B1 B2 B3 STEP            s1: F0 F1 B0 F2 B1 F3 B2 B3 STEP
            s2: F0 F1 F2 F3 B0 B1 B2 B3 STEP            s2: F0 B0 F1 B1 F2 B2 F3 B3 STEP

`async` is 1f1b without the flush: STEP after every backward (PipeDream SOSP'19 §3.3); `2bw` steps after
each worker's last backward of a minibatch, with two weight versions (PipeDream-2BW, ICML'21 §3.1).
`zb` and `zb-h2` split each backward into B and W (ZB ICLR'24 §2; their orders: pipeflow/zerobubble.py).
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeflow.actions import STEP, Action, B, F, Kind, ScheduleError
from pipeflow.interleave import interleave_round, interleaved_order  # noqa: F401  (interleave_round: re-exported)
from pipeflow.warmup import fill_warmup, warmup_forwards  # noqa: F401  (fill_warmup: re-exported)
from pipeflow.zerobubble import zero_bubble_order

DEFAULT_VIRTUAL_STAGES = 2  # model chunks per rank when a round-robin schedule is not told how many


class Weights(enum.Enum):
    """Which weights a microbatch uses (the engine's WeightPolicy, the memory model's versions)."""

    LIVE = "live"  # the current weights: updates happen only after a flush
    STASH = "stash"  # PipeDream weight stashing: a version per microbatch in flight (SOSP'19 §3.3)
    DOUBLE_BUFFER = "double buffer"  # PipeDream-2BW: the live weights and one older version (stashed_versions)


class InFlight(enum.Enum):
    """Microbatches whose activations a replica keeps at once."""

    ALL = "all"  # every local microbatch of the minibatch (gpipe)
    FILL = "fill"  # enough to fill the workers downstream (1F1B's warm-up + 1)
    FILL_UP_TO_ALL = "fill, at most all"  # FILL, capped by the minibatch's local microbatches (flushed 1f1b)
    # (chunk, microbatch) pairs: interleaved 1F1B's warm-up (v-1)*share + 2*(FILL-1), + 1, at most all
    INTERLEAVED = "interleaved warm-up"
    PIPELINE = "pipeline, at most all"  # ceil(workers / replicas): 1F1B's first stage on every stage (zb)
    TWICE_PIPELINE = "twice the pipeline, at most all"  # 2 ceil(workers / replicas) - 1 (zb-h2)


# (worker's microbatches, microbatches in the list, replicas, stage, minibatch, warmup) -> compute order
OrderFn = Callable[[list[int], int, Sequence[int], int, "int | None", "int | None"], list[Action]]
# (worker's microbatches, microbatches in the list, replicas per group, group, virtual stages) -> compute
# order over the worker's chunks, every action naming its model stage (schedules with chunk_order)
ChunkOrderFn = Callable[[list[int], int, Sequence[int], int, int], list[Action]]


@dataclass(frozen=True)
class ScheduleKind:
    """The rules of one schedule. `order` generates one worker's compute actions and STEPs."""

    name: str
    order: OrderFn
    flush: bool  # drains each minibatch: one STEP per minibatch, gradients equal to gpipe's
    step_per_backward: bool  # an update after every backward of a replica (async), not per minibatch
    mean_over_replicas: bool  # replicas average their gradients (PipeDream's DDP) rather than sum them
    weights: Weights
    in_flight: InFlight
    warmup_applies: bool  # --warmup may deepen the warm-up (its weight versions do not depend on it)
    ties_allowed: bool  # parameters shared across stages train as one (needs a common weight version)
    agree_every_step: bool  # the failure supervisor's ranks agree at every STEP (else at segment ends)
    replicas_divide_m: bool  # every stage's replica count divides m
    replicas_at_most_m: bool  # m >= every stage's replica count
    # every replica's share of a minibatch, m // r_s, covers its warm-up forwards w_s (two weight versions
    # suffice): PipeDream-2BW's m >= S - 1 without replicas, and any --warmup it runs with
    share_covers_warmup: bool
    # Chunks placed round-robin (--virtual-stages v: S*v model stages, stage k on rank group k mod S; a
    # plan may then list a rank group once per chunk); generates the orders instead of `order`.
    chunk_order: ChunkOrderFn | None = None
    m_multiple_of_stages: bool = False  # m is a multiple of the rank groups S (Megatron's interleaving)
    # The parameter sets `--schedule auto` plans this record with (keyword arguments of the planning service)
    variants: tuple[tuple[tuple[str, int], ...], ...] = ((),)
    split_backward: bool = False  # B computes input gradients only, W the weight gradients (split.py)

    @property
    def default_virtual_stages(self) -> int:
        """Chunks per rank without --virtual-stages: DEFAULT_VIRTUAL_STAGES where chunks go round-robin, else 1."""
        return DEFAULT_VIRTUAL_STAGES if self.chunk_order is not None else 1

    @property
    def rule(self) -> str:
        """The constraints on m and replicas in words, for the planner's messages ("" if none)."""
        rules = ((self.replicas_divide_m, "every stage's replica count must divide m"),
                 (self.replicas_at_most_m, "m >= every stage's replica count"),
                 (self.share_covers_warmup, "m // replicas >= warm-up forwards on every stage (m >= stages - 1 "
                  "without replicas)"), (self.m_multiple_of_stages, "m a multiple of the pipeline's rank groups "
                                         "(at least 2)"))
        return " and ".join(text for applies, text in rules if applies)

    @property
    def vertical_sync(self) -> bool:
        """--vertical-sync: stashed versions can be made consistent across stages (PipeDream §3.3)."""
        return self.weights is Weights.STASH

    def loss_scale(self, m: int) -> float:
        """Each microbatch's loss weight: 1/m when a step sums m microbatches' gradients, 1 when it takes one."""
        return 1.0 if self.step_per_backward else 1.0 / m

    def microbatches_per_update(self, m: int, replicas: int) -> int:
        """Microbatches one STEP of a stage consumes over its replicas."""
        return replicas if self.step_per_backward else m

    def stashed_versions(self, in_flight: Any, share: Any = 1.0) -> Any:
        """Copies of the weights kept beside the live ones at peak (memory model), for `in_flight` microbatches
        (a count or an array), as stash.py's VersionBook holds them. A forward whose backward comes after an update
        runs on a copy taken before it: async one per microbatch in flight, none on the last stage; 2bw two where
        forwards run ahead (the older version, for the minibatch's last backwards, and a copy of the live one for
        the next minibatch's first forwards), else the gradient its deferred update holds (update.py): `share`."""
        if self.weights is Weights.STASH:
            return in_flight * (in_flight > 1)
        if self.weights is Weights.DOUBLE_BUFFER:
            return 2 * (in_flight > 1) + share * (in_flight <= 1)
        return 0

    def broadcast_overlaps(self, last: Any) -> Any:
        """--shard-optimizer (shard.py), on the model's `last` stage or not (bool or array): the owners' weights
        travel under the next minibatch where 2bw runs it on a stashed version (every stage but the last)."""
        return (self.weights is Weights.DOUBLE_BUFFER) & (last == 0)

    def exchange_exposed_ms(self, exchange_ms: Any, last: Any, forward_ms: Any, first: Any, tail_ms: Any) -> Any:
        """--shard-optimizer: what of the owners' exchange a stage waits for: none where it overlaps, all (async's
        STEP), else (shard.ShardedUpdate.arm: layer by layer under a forward of `tail_ms` in its last layer) the
        `first` layer's share of the bytes, or the exchange and the last layer's forward beyond the whole forward."""
        first, rest = exchange_ms * first, exchange_ms + tail_ms - forward_ms  # (floats or arrays: the larger below)
        waits = exchange_ms if self.step_per_backward else (first + rest + abs(first - rest)) / 2
        return waits * (self.broadcast_overlaps(last) == 0)

    def reduce_waits_a_step(self, last: Any, sharded: Any) -> Any:
        """The replicas' all-reduce launched at a STEP, completed at the next (under the next minibatch) where 2bw
        defers an unsharded update (its last stage, data parallelism: update.py); else in the backward."""
        return (self.weights is Weights.DOUBLE_BUFFER) & (last != 0) & (sharded == 0)

    def copies_per_update(self, replicas: Sequence[int], stage: int) -> int:
        """Weight copies `stage` takes per optimizer update in the steady state (stash.py's VersionBook): one where
        forwards run ahead of their backwards (async: the version a later backward needs; 2bw: once per minibatch),
        none on the last stage (2bw defers its update instead, update.py) and under the flush schedules."""
        if self.weights is Weights.LIVE:
            return 0
        return int(warmup_forwards(replicas, stage) > 0)

    def violation(self, m: int, replicas: Sequence[int], warmup: Sequence[int] | None = None) -> str | None:
        """Why this schedule cannot run these replica counts at m microbatches (None: it can): async's replicas divide
        m (each steps as often); 2bw (PipeDream-2BW §3.1): m >= r_s and m // r_s >= w_s, the warm-up (`warmup`)."""
        reps = list(replicas)
        if self.replicas_divide_m and any(m % r for r in reps):
            return (f"{self.name} needs every stage's replica count to divide the microbatches per step, found "
                    f"replicas {reps} and --microbatches {m}")
        if self.replicas_at_most_m and max(reps) > m:
            return f"{self.name} needs --microbatches >= every stage's replica count, found {m} < {max(reps)}"
        if self.share_covers_warmup:
            warm = list(warmup) if warmup is not None else [warmup_forwards(reps, s) for s in range(len(reps))]
            short = [s for s, (r, w) in enumerate(zip(reps, warm)) if m // r < w]
            if short:
                s = short[0]
                return (f"{self.name} needs every replica's share of a minibatch (--microbatches // replicas) to "
                        f"cover its warm-up forwards (two weight versions), found stage {s} with {reps[s]} "
                        f"replica(s) and {warm[s]} warm-up forward(s) at {m} microbatches"
                        + (" (m >= stages - 1 without replicas)" if warmup is None and max(reps) == 1 else ""))
        if self.m_multiple_of_stages and (len(reps) < 2 or m % len(reps)):
            return (f"{self.name} needs at least 2 pipeline rank groups and --microbatches a multiple of their "
                    f"number (Megatron's interleaving), found {m} microbatches for {len(reps)} groups")
        return None


# ---------------------------------------------------------------- generators


def _one_f_one_b(mbs: list[int], warmup: int) -> list[Action]:
    warmup = min(warmup, len(mbs))
    order = [F(i) for i in mbs[:warmup]]
    for k, i in enumerate(mbs[warmup:]):
        order += [F(i), B(mbs[k])]
    order += [B(i) for i in mbs[len(mbs) - warmup:]] if warmup else []
    return order


def _1f1b_body(mbs: list[int], replicas: Sequence[int], stage: int, warmup: int | None) -> list[Action]:
    return _one_f_one_b(mbs, warmup_forwards(replicas, stage) if warmup is None else warmup)


def _gpipe(mbs: list[int], microbatches: int, replicas: Sequence[int], stage: int,
           minibatch: int | None, warmup: int | None) -> list[Action]:
    return [F(i) for i in mbs] + [B(i) for i in mbs] + [STEP]


def _1f1b(mbs: list[int], microbatches: int, replicas: Sequence[int], stage: int,
          minibatch: int | None, warmup: int | None) -> list[Action]:
    return _1f1b_body(mbs, replicas, stage, warmup) + [STEP]


def _async(mbs: list[int], microbatches: int, replicas: Sequence[int], stage: int,
           minibatch: int | None, warmup: int | None) -> list[Action]:
    # PipeDream: an update after every backward, no flush; replicas all-reduce at every STEP: as many backwards.
    if microbatches % replicas[stage]:
        raise ScheduleError(f"async: stage {stage} has {replicas[stage]} replicas, which must divide the "
                            f"total number of microbatches (steps x m), found {microbatches}")
    order = _1f1b_body(mbs, replicas, stage, warmup)
    return [a for x in order for a in ((x, STEP) if x.kind is Kind.B else (x,))]


def _2bw(mbs: list[int], microbatches: int, replicas: Sequence[int], stage: int,
         minibatch: int | None, warmup: int | None) -> list[Action]:
    # PipeDream-2BW: 1F1B without flush; an update after this worker's last backward of each minibatch (m >= replicas).
    if not minibatch or minibatch < 1:
        raise ScheduleError(f"2bw needs the minibatch size in microbatches, found {minibatch}")
    if minibatch < replicas[stage] or microbatches % minibatch:
        raise ScheduleError(f"2bw: stage {stage} has {replicas[stage]} replicas and minibatches of {minibatch} "
                            f"microbatches over {microbatches} in all; need m >= replicas and m dividing the "
                            "total, so that every replica steps once per minibatch")
    warm = warmup_forwards(replicas, stage) if warmup is None else warmup
    if minibatch // replicas[stage] < warm:  # a minibatch's first forward would need the update before it
        raise ScheduleError(f"2bw: stage {stage} has {replicas[stage]} replica(s) and {warm} warm-up forward(s), more "
                            f"than its share of a minibatch of {minibatch} microbatches (two weight versions)")
    last = {max(i for i in mbs if i // minibatch == k) for k in {i // minibatch for i in mbs}}
    out: list[Action] = []
    for x in _1f1b_body(mbs, replicas, stage, warmup):
        out.append(x)
        if x.kind is Kind.B and x.microbatch in last:
            out.append(STEP)
    return out


def zero_bubble_limit(in_flight: InFlight, workers: int, replicas: Any, fill_peak: int | None = None) -> Any:
    """Microbatches a replica of a zero-bubble schedule holds at most (forward run, W not yet), ZB ICLR'24
    §2.1-2.2: ZB-H1 keeps 1F1B's peak, the first stage's ceil(workers / replicas), on every stage; ZB-H2 twice
    that minus one (the paper's S and 2S - 1). With replicas the count is also capped by `fill_peak`, 1F1B's
    most over all stages (the generator's rule); without it (the planner's DP, which does not know the other
    stages; `workers` and `replicas` may be numpy arrays) the result is an upper bound."""
    fill = -(-workers // replicas)
    if fill_peak is not None:
        fill = min(fill, fill_peak)
    return 2 * fill - 1 if in_flight is InFlight.TWICE_PIPELINE else fill


def _zero_bubble(twice: bool) -> OrderFn:
    in_flight = InFlight.TWICE_PIPELINE if twice else InFlight.PIPELINE

    def order(mbs: list[int], microbatches: int, replicas: Sequence[int], stage: int,
              minibatch: int | None, warmup: int | None) -> list[Action]:
        warm = [(2 if twice else 1) * warmup_forwards(replicas, t) for t in range(len(replicas))]
        # 1F1B's most held by any worker (its first replica holds the most of a stage's microbatches)
        peak = max(min(warmup_forwards(replicas, t) + 1, -(-microbatches // r)) for t, r in enumerate(replicas))
        limits = [zero_bubble_limit(in_flight, sum(replicas), r, peak) for r in replicas]
        return zero_bubble_order(mbs, microbatches, replicas, stage, warmups=warm, limits=limits)
    return order


def _interleaved_v1(mbs: list[int], microbatches: int, replicas: Sequence[int], stage: int,
                    minibatch: int | None, warmup: int | None) -> list[Action]:
    return interleaved_order(mbs, microbatches, replicas, stage, 1)


# ---------------------------------------------------------------- the table

def _flushed(name: str, order: OrderFn, in_flight: InFlight, *, warmup_applies: bool,
             split_backward: bool = False) -> ScheduleKind:
    return ScheduleKind(name, order, flush=True, step_per_backward=False, mean_over_replicas=False,
                        weights=Weights.LIVE, in_flight=in_flight, warmup_applies=warmup_applies, ties_allowed=True,
                        agree_every_step=True, replicas_divide_m=False, replicas_at_most_m=False,
                        share_covers_warmup=False, split_backward=split_backward)


TABLE: tuple[ScheduleKind, ...] = (
    _flushed("gpipe", _gpipe, InFlight.ALL, warmup_applies=False),
    _flushed("1f1b", _1f1b, InFlight.FILL_UP_TO_ALL, warmup_applies=True),
    ScheduleKind("async", _async, flush=False, step_per_backward=True, mean_over_replicas=True,
                 weights=Weights.STASH, in_flight=InFlight.FILL, warmup_applies=False, ties_allowed=False,
                 agree_every_step=False, replicas_divide_m=True, replicas_at_most_m=False,
                 share_covers_warmup=False),
    ScheduleKind("2bw", _2bw, flush=False, step_per_backward=False, mean_over_replicas=False,
                 weights=Weights.DOUBLE_BUFFER, in_flight=InFlight.FILL, warmup_applies=True, ties_allowed=False,
                 agree_every_step=False, replicas_divide_m=False, replicas_at_most_m=True,
                 share_covers_warmup=True),
    ScheduleKind("interleaved", _interleaved_v1, flush=True, step_per_backward=False, mean_over_replicas=False,
                 weights=Weights.LIVE, in_flight=InFlight.INTERLEAVED, warmup_applies=False, ties_allowed=True,
                 agree_every_step=True, replicas_divide_m=False, replicas_at_most_m=False,
                 share_covers_warmup=False, chunk_order=interleaved_order, m_multiple_of_stages=True,
                 variants=((('virtual_stages', DEFAULT_VIRTUAL_STAGES),),)),
    _flushed("zb", _zero_bubble(False), InFlight.PIPELINE, warmup_applies=False, split_backward=True),
    _flushed("zb-h2", _zero_bubble(True), InFlight.TWICE_PIPELINE, warmup_applies=False, split_backward=True),
)
_BY_NAME = {k.name: k for k in TABLE}
SCHEDULES = tuple(_BY_NAME)
WARMUP_SCHEDULES = " and ".join(k.name for k in TABLE if k.warmup_applies)  # for messages: "1f1b and 2bw"


def schedule_kind(name: str) -> ScheduleKind:
    """The record of schedule `name`; ScheduleError naming the known ones for any other."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ScheduleError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}") from None
