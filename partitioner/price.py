"""A plan's price: per-stage costs from the profile columns and the topology, the schedule's rules, and the
simulated step time (the one figure `pipeflow-plan` optimises, reports and writes as `predicted`)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partitioner.planner import LayerCosts
from partitioner.simulate import SimResult, StageCost, simulate
from partitioner.topology import Topology
from pipeflow.actions import ScheduleError
from pipeflow.kinds import ScheduleKind, schedule_kind
from pipeflow.warmup import least_warmups

# tune_warmup keeps an extra warm-up forward per stage only where the simulated step shrinks by this share:
# each costs a microbatch's activations on every stage but the last.
WARMUP_GAIN = 0.005


def schedule_rule(schedule: str, microbatches: int, replicas: Sequence[int]) -> str | None:
    """Why the schedule cannot run these stages (None: it can): the kind table's constraints."""
    return schedule_kind(schedule).violation(microbatches, replicas)


def level_factors(ranks: Sequence[int], topology: Topology) -> list[int]:
    """How many groups of each level the ranks span inside one group of the level above, in the fullest
    such group: the ring sizes of a hierarchical all-reduce among them. Replicas need not fill whole groups
    (15 ranks of 4x4 workers: three full servers and three GPUs of the fourth): each level's ring runs in
    every group at once, so the fullest group sets its time."""
    out = []
    for k in range(len(topology.levels)):
        per_group: dict[int, set[int]] = {}
        for r in ranks:
            per_group.setdefault(r // topology.unit_size(k + 1), set()).add(r // topology.unit_size(k))
        out.append(max((len(units) for units in per_group.values()), default=1))
    return out


def stage_costs(lay: LayerCosts, topology: Topology, ranges: Sequence[tuple[int, int]],
                ranks: Sequence[Sequence[int]], kind: ScheduleKind, *, scale: float = 1.0) -> list[StageCost]:
    """Per stage: compute (the loss on the last; the runtime's own time per action and message sent,
    LayerCosts.stage_overhead_ms), its output, a ring all-reduce 2 (r-1)/r P / B for each level its replicas span,
    the optimizer step (and the sum of a parameter shared with other stages, partitioner/ties.py). send_ms is for
    the table: one message at the bandwidth between the first replicas of this stage and the next (the simulator
    prices every pair itself). `scale` multiplies the layers' and the loss's times (contention_scale). With
    lay.shard_optimizer an update is a 1/r share of the step, then what the others' weights keep waiting (the
    schedule `kind`'s exchange_exposed_ms), and the all-reduce waits a STEP where kind.reduce_waits_a_step says so."""
    L, out = len(lay), []
    for t, ((a, b), rs) in enumerate(zip(ranges, ranks)):
        held, p = float(lay.params(a, b)), float(lay.trainable(a, b))  # a shared parameter once; not frozen
        extra_f, extra_b = lay.stage_overhead_ms(a, b)  # the runtime's own time (costmodel, as in the DP)
        fwd = scale * (float(lay.forward_ms[a:b].sum()) + (lay.loss_ms if b == L else 0.0)) + float(extra_f)
        nbytes = float(lay.output_bytes[b - 1]) if t + 1 < len(ranges) else 0.0
        send = 0.0
        if t + 1 < len(ranges):
            send = nbytes / (topology.levels[topology.level_of(rs[0], ranks[t + 1][0])].bandwidth / 1e3)
        factors = [(f, topology.levels[k].bandwidth / 1e3) for k, f in enumerate(level_factors(rs, topology)) if f > 1]
        ar = sum(2.0 * (f - 1) / f * p / bw for f, bw in factors)
        weight = 0.0 if lay.backward_weight_ms is None else scale * float(lay.backward_weight_ms[a:b].sum())
        share = 1.0 / len(rs) if lay.shard_optimizer else 1.0  # --shard-optimizer: a 1/r share of the update,
        update = lay.optimizer_ms_per_byte * p * share + (  # then the owners' exchange, priced as the all-reduce
            float(kind.exchange_exposed_ms(ar, b == L, fwd, float(lay.parameter_bytes[a]) / max(p, 1.0),
                                           fwd - scale * float(lay.forward_ms[a:b - 1].sum())))
            if lay.shard_optimizer else 0.0)  # (costmodel.update_ms)
        out.append(StageCost(fwd, scale * float(lay.backward_ms[a:b].sum()) + float(extra_b), send, ar, p,
                             float(lay.activation_bytes[a:b].sum() + lay.boundary_bytes(a, b)
                                   + (lay.loss_saved_bytes if b == L else 0.0)), update, nbytes, weight,
                             lay.latency_ms, lay.message_ms, lay.loss_bytes - lay.loss_saved_bytes if b == L else 0.0,
                             share,
                             bool(kind.reduce_waits_a_step(b == L, lay.shard_optimizer)), held - p,
                             float(lay.buffers(a, b))))
    for _, size, stages in lay.ties.across(ranges):  # a shared parameter's copies summed at the STEP (reduce.py)
        holders = sorted({r for s in stages for r in ranks[s]})
        ring = sum(2.0 * (f - 1) / f * size / (topology.levels[k].bandwidth / 1e3)
                   for k, f in enumerate(level_factors(holders, topology)) if f > 1)
        seen: set[tuple[int, ...]] = set()
        for s in stages:
            out[s].optimizer_ms += ring
            if tuple(ranks[s]) in seen:  # another chunk of the same ranks holds it: one Parameter there (links.py)
                out[s].parameter_bytes = max(0.0, out[s].parameter_bytes - size)
            seen.add(tuple(ranks[s]))
    return out


@dataclass
class Priced:
    """A plan as the search prices it: its stages' costs, its simulation and the warm-up it runs with (1f1b's
    and 2bw's forwards before the first backward per stage; None: the schedule's minimum)."""

    costs: list[StageCost]
    sim: SimResult
    warmup: list[int] | None = None


def price(lay: LayerCosts, topology: Topology, schedule: str, microbatches: int,
          ranges: Sequence[tuple[int, int]], ranks: Sequence[Sequence[int]], *, optimizer: str,
          keep_timeline: bool = False, warmup: Sequence[int] | None = None) -> tuple[list[StageCost], SimResult]:
    """Stage costs and the simulation of the plan (ranks per stage in replica order); `warmup` (1f1b, 2bw):
    the forwards before the first backward per stage, None for the schedule's minimum."""
    # Stage k on the ranks of stage k mod S (chunks placed round-robin, partitioner/plan.py): v = stages / S.
    groups = next((k for k in range(1, len(ranks)) if list(ranks[k]) == list(ranks[0])), len(ranks))
    kind, reps = schedule_kind(schedule), [len(r) for r in ranks[:groups]]  # a rank group's replicas

    def run(scale: float) -> tuple[list[StageCost], SimResult]:
        costs = stage_costs(lay, topology, ranges, ranks, kind, scale=scale)
        for cost, (a, b), rs in zip(costs, ranges, ranks):  # under CUDA graphs, as CostModel.memory_bytes
            cost.transient_bytes += float(lay.graph_bytes(a, b, -(-microbatches // len(rs))))
        for s, cost in enumerate(costs[:groups]):  # the runtime's own time per update (a rank's chunks together)
            # and the weight copies an update makes the asynchronous schedules keep (ScheduleKind.copies_per_update)
            cost.optimizer_ms += lay.update_ms + lay.copy_ms_per_byte * (  # every weight is copied, frozen too
                cost.parameter_bytes + cost.frozen_bytes) * kind.copies_per_update(reps, s)
        sim = simulate(schedule, costs, [len(r) for r in ranks], microbatches, optimizer=optimizer,
                       keep_timeline=keep_timeline, ranks=ranks, topology=topology,
                       virtual_stages=len(ranks) // groups, warmup=warmup)
        sim.step_ms += lay.step_gap_ms  # the runtime's time between two steps (calibrated), once per step
        return costs, sim

    costs, sim = run(1.0)
    scale = contention_scale(lay, sim, sum(reps))
    return run(scale) if scale > 1.0 else (costs, sim)


def contention_scale(lay: LayerCosts, sim: SimResult, workers: int) -> float:
    """How much slower a plan's layers run than profiled alone because its ranks compute at once (issue 13):
    1 + (contention - 1) u, where profile.json's `contention` is a pass beside ranks computing all the time over
    one alone and u the share of the step the plan's ranks compute (1 - the simulated bubble, its run with the
    layers as profiled). A data-parallel plan's ranks always compute; a pipeline's wait for each other. One
    worker: 1. At least 1, so the DP's bound, which prices the layers alone, stays below the simulation."""
    if workers < 2 or lay.contention <= 1.0:
        return 1.0
    return 1.0 + (lay.contention - 1.0) * max(0.0, 1.0 - sim.bubble_fraction)


def tune_warmup(lay: LayerCosts, topology: Topology, schedule: str, microbatches: int,
                ranges: Sequence[tuple[int, int]], ranks: Sequence[Sequence[int]], *, optimizer: str,
                memory_per_worker: float | None, priced: Priced, keep_timeline: bool = False) -> Priced:
    """1f1b's warm-up depth for this plan: DAPPLE's minimum (S-1-s forwards before the first backward) leaves
    a stage idle whenever the round trip of its oldest microbatch through the stages after it, messages
    included, takes longer than the forwards it runs meanwhile; stages whose forward and backward are
    balanced differently (the loss on the last) or messages that take time make that happen every
    microbatch. Each extra forward on every stage but the last is kept while the simulated step shrinks by
    at least WARMUP_GAIN and every stage's peak memory still fits. `priced` is price()'s result at the
    minimum."""
    costs, sim = priced.costs, priced.sim
    reps = [len(r) for r in ranks]
    S = len(ranges)
    kind = schedule_kind(schedule)
    # Flushed schedules only: 2bw runs a given warm-up (--warmup, plan.json), but on 2 H200s a deeper one gained
    # nothing measurable (-0.2% and +0.6% at 8 x 8, 14,12 layers) where the simulation promised 1.1% and 3.1%,
    # for 6.5 and 13 GiB more on stage 0 (benchmarks/gpu/README.md).
    if not kind.warmup_applies or not kind.flush or S < 2:
        return Priced(costs, sim)
    least = least_warmups(reps)
    best: list[int] | None = None
    for extra in range(1, microbatches):
        # past m no change (a stage runs at most m forwards first), and plan.json refuses counts over m
        counts = [min(microbatches, w + (extra if s < S - 1 else 0)) for s, w in enumerate(least)]
        try:
            c2, s2 = price(lay, topology, schedule, microbatches, ranges, ranks, optimizer=optimizer,
                           keep_timeline=keep_timeline, warmup=counts)
        except ScheduleError:  # counts whose order deadlocks (the replay detects it): keep the last that ran
            break
        fits = memory_per_worker is None or max(s2.peak_memory_bytes) <= memory_per_worker
        if not fits or s2.step_ms > sim.step_ms * (1 - WARMUP_GAIN):
            break
        best, costs, sim = counts, c2, s2
    return Priced(costs, sim, best)


def predicted(sim: SimResult, microbatches: int, microbatch_size: int) -> dict[str, Any]:
    step_s = sim.step_ms / 1e3
    return {"step_ms": round(sim.step_ms, 6),
            "samples_per_s": round(microbatches * microbatch_size / step_s, 3) if step_s > 0 else 0.0,
            "bubble_fraction": round(sim.bubble_fraction, 6),
            "peak_memory_bytes": [float(x) for x in sim.peak_memory_bytes]}
