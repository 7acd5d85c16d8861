"""The planning service: profile -> plan through the DP (planner.py), each candidate priced by the simulator
(simulate.py), as a library that pipeflow-plan (cli.py) and pipeflow-train's planning on the spot both call.

The DP bounds every plan's step time from below; the simulator replays the schedule on the plans in order
of bound until no unvisited plan can be faster, so the plan returned is the fastest the simulator knows."""
from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

from partitioner.accumulation import priced_as
from partitioner.inputs import MAX_MICROBATCHES, MAX_WORKERS, check_microbatches, resolve_topology  # noqa: F401  (re-exported: the limits)
from partitioner.layercosts import layer_costs  # noqa: F401  (re-exported)
from partitioner.plan import Plan, PlanError, StagePlan
from partitioner.planner import (
    SCHEDULES,
    CostModel,
    LayerCosts,
    PlanningError,
    Progress,
    Solution,
    tabulate,
)
from partitioner.price import Priced, predicted, price, schedule_rule, tune_warmup
from partitioner.profile import Profile
from partitioner.search import search
from partitioner.simulate import SimResult, StageCost
from partitioner.ties import split_tie_error
from partitioner.topology import Level, Topology, format_bytes, parse_bytes
from pipeflow.actions import ScheduleError
from pipeflow.kinds import InFlight, schedule_kind

# --microbatches auto: the smallest power of two up to AUTO_MAX_MICROBATCHES whose simulated bubble (share
# of worker time not computing, all-reduce waits included) is at most AUTO_BUBBLE; failing that, the
# candidate with the highest simulated throughput. More microbatches shrink the fill/drain bubble,
# (S-1)/(m+S-1) for 1F1B, but cost activation memory (gpipe) and a larger minibatch.
AUTO_BUBBLE = 0.10
AUTO_MAX_MICROBATCHES = 256
# Plans simulated per search (partitioner/search.py), and microbatch-stages replayed, before it settles for
# the best so far (about 0.5 s of simulation on the 2-core CI machine).
SEARCH_LIMIT = 64
SEARCH_WORK = 50_000
# On several levels the DP replicates a stage over whole inner groups only; plans whose replica counts are
# not multiples of a group (PipeDream's VGG-16 15-1 on 4x4 GPUs) come from a second search over one flat
# level of all workers at the slowest bandwidth, priced on the real topology. Done where that DP is cheap.
FLAT_CANDIDATES_MAX = 4096  # layers x workers
FLAT_LIMIT = 16


@dataclass
class Planned:
    """The plan with what the table and the timeline need."""

    plan: Plan
    costs: list[StageCost]
    sim: SimResult
    solution: Solution | None = None


def _explain(model: CostModel, workers: int) -> PlanningError:
    """Why no plan exists: structure (--straight), the schedule's rules, or memory (name the stage)."""
    m, L = model.microbatches, model.num_layers
    if model.straight and workers > L:
        return PlanningError(f"cannot place {workers} workers on {L} layers with --straight: every stage "
                             f"needs at least one layer; use fewer workers or allow replication")
    limit = model.memory_per_worker
    model.memory_per_worker = None
    try:
        sol = _search(model)
    except PlanningError:
        kind = schedule_kind(model.schedule)
        tied = [] if kind.ties_allowed else [", ".join(map(str, t)) for t in model.layers.ties.spans]
        rule = " and ".join([kind.rule] * bool(kind.rule) + [f"layers {t} (sharing parameters) on one stage"
                                                             for t in tied[:2]])
        return PlanningError(f"no plan of {L} layers on {workers} workers fits --schedule {model.schedule} with "
                             f"{m} microbatches ({rule or 'no plan'}); use another --microbatches or fewer "
                             "workers")
    finally:
        model.memory_per_worker = limit
    costs, sim = sol[1].costs, sol[1].sim
    s = max(range(len(costs)), key=lambda k: sim.peak_memory_bytes[k])
    st, need, fl = sol[0].stages[s], sim.peak_memory_bytes[s], sim.peak_in_flight[s]
    act = fl * costs[s].activation_bytes
    ways = [w for w in ("more workers", "sgd" * (model.optimizer != "sgd"), "fewer microbatches",
                        "--schedule 1f1b" * (model.kind.in_flight is InFlight.ALL)) if w]  # gpipe holds all m
    return PlanningError(
        f"no plan fits --memory-per-worker {format_bytes(limit or 0)}: even the fastest plan's stage {s} "
        f"(layers [{st.start}, {st.end}), {len(st.ranks)} replica(s)) needs {format_bytes(need)} "
        f"(weights, gradients, optimizer state {format_bytes(need - act)} + activations of {fl} microbatch(es) "
        f"{format_bytes(act)}); use {', '.join(ways[:-1])} or {ways[-1]}")


def _search(model: CostModel, keep_timeline: bool = False) -> tuple[Solution, Priced, dict[str, object]]:
    """The DP's bounds ordered, the simulator deciding (partitioner/search.py)."""
    cache: dict[tuple[tuple[int, int, tuple[int, ...]], ...], Priced] = {}

    def run(sol: Solution, timeline: bool = False) -> Priced:
        ranges = [(st.start, st.end) for st in sol.stages]
        ranks = [sorted(st.ranks) for st in sol.stages]
        key = tuple((a, b, tuple(r)) for (a, b), r in zip(ranges, ranks))
        if key not in cache or timeline:
            cache[key] = Priced(*price(model.layers, model.topology, model.schedule, model.microbatches, ranges,
                                       ranks, optimizer=model.optimizer, keep_timeline=timeline))
        return cache[key]

    def cost(sol: Solution) -> float | None:
        if schedule_rule(model.schedule, model.microbatches, [len(st.ranks) for st in sol.stages]):
            return None
        return run(sol).sim.step_ms

    def work(sol: Solution) -> float:
        """Compute actions the simulation replays (async, 2bw: two runs of several minibatches)."""
        runs = 1 if schedule_kind(model.schedule).flush else 2 * max(2, -(-2 * model.topology.workers // m)) + 2
        return runs * m * len(sol.stages)

    m = model.microbatches
    found = search(tabulate(model, Progress(_progress)), cost, limit=SEARCH_LIMIT, work=work, budget=SEARCH_WORK)
    partial = False
    topo = model.topology
    if len(topo.levels) > 1 and model.num_layers * topo.workers <= FLAT_CANDIDATES_MAX:
        flat = replace(model, topology=Topology((Level(topo.workers, min(lv.bandwidth for lv in topo.levels)),)))
        try:
            other = search(tabulate(flat), cost, limit=FLAT_LIMIT, work=work, budget=SEARCH_WORK / 4)
        except PlanningError:
            other = None
        if other is not None and other.step_ms < found.step_ms:
            found, partial = replace(other, exact=False), True
    priced = run(found.solution, keep_timeline)
    # The bound is proven below the simulated time for flushed schedules on one level (tests/
    # test_planner_bruteforce.py); elsewhere the search is the simulator's choice among the DP's best bounds.
    # Not for a split backward: the DP's round trip counts whole backwards, so it does not bound zb's.
    kind = schedule_kind(model.schedule)
    exact = found.exact and kind.flush and not kind.split_backward and len(model.topology.levels) == 1
    info: dict[str, object] = {"bound_ms": round(found.solution.objective_ms, 6), "plans_simulated": found.simulated,
                               "exact": exact}
    if partial:
        info["partial_groups"] = True  # from the flat search: its bound is of one flat level, not this topology
    return found.solution, priced, info


def _progress(line: str) -> None:
    sys.stderr.write(f"pipeflow-plan: {line}\n")  # one write per line: no interleaving
    sys.stderr.flush()


def _plan_once(profile: Profile, model: CostModel, workers: int, keep_timeline: bool) -> Planned:
    try:
        sol, priced, info = _search(model, keep_timeline)
    except PlanningError:
        raise _explain(model, workers) from None
    m = model.microbatches
    # The split is the fastest at the schedule's own warm-up; then, on GPUs, the warm-up is deepened where the
    # simulation gains (1f1b; on CPU ranks sharing cores send with their own CPU time, which no warm-up hides).
    if profile.device.startswith("cuda"):
        priced = tune_warmup(model.layers, model.topology, model.schedule, m, [(s.start, s.end) for s in sol.stages],
                             [sorted(s.ranks) for s in sol.stages], optimizer=model.optimizer, priced=priced,
                             memory_per_worker=model.memory_per_worker, keep_timeline=keep_timeline)
    stages = [StagePlan((s.start, s.end), len(s.ranks), sorted(s.ranks)) for s in sol.stages]
    extra: dict[str, object] = {"planner": {"topology": str(model.topology), "optimizer": model.optimizer,
                                            "objective_ms": info["bound_ms"],
                                            "microbatch_size": profile.microbatch_size, "search": info}}
    if priced.warmup is not None:
        extra["warmup"] = priced.warmup
    if model.layers.shard_optimizer and any(len(s.ranks) > 1 for s in sol.stages):
        extra["shard_optimizer"] = True  # priced so (CostModel.update_ms); pipeflow-train runs it so
    plan = Plan(model.schedule, m, workers, stages, predicted(priced.sim, m, profile.microbatch_size), extra)
    return Planned(plan, priced.costs, priced.sim, sol)


def plan_detailed(profile: Profile, workers: int, *, schedule: str = "1f1b", microbatches: int | str = "auto",
                  topology: Topology | str | None = None, memory_per_worker: int | str | None = None,
                  straight: bool = False, optimizer: str = "adam", keep_timeline: bool = False,
                  virtual_stages: int = 1, shard_optimizer: bool = False) -> Planned:
    topo = resolve_topology(workers, topology, profile)
    if microbatches != "auto":
        check_microbatches(microbatches)
    if isinstance(memory_per_worker, str):
        memory_per_worker = parse_bytes(memory_per_worker)
    if schedule not in SCHEDULES:
        raise PlanningError(f"--schedule must be one of {', '.join(SCHEDULES)}, found {schedule!r}")
    lay = replace(layer_costs(profile, schedule, optimizer), shard_optimizer=shard_optimizer)
    if schedule_kind(schedule).chunk_order is not None or virtual_stages != 1:
        return _chunked(profile, lay, topo, schedule, microbatches, workers, virtual_stages, optimizer,
                        None if memory_per_worker is None else float(memory_per_worker), keep_timeline)

    def model_for(m: int) -> CostModel:
        return CostModel(lay, topo, schedule, m, optimizer,
                         None if memory_per_worker is None else float(memory_per_worker), straight)

    if microbatches != "auto":
        assert isinstance(microbatches, int)
        return _plan_once(profile, model_for(microbatches), workers, keep_timeline)
    # A flushed minibatch lasts at least one round trip, sum(t), for m sum(t) of work on `workers`: the bubble
    # 1 - m sum(t) / (workers T) reaches AUTO_BUBBLE only when m >= (1 - AUTO_BUBBLE) workers.
    least = math.ceil((1 - AUTO_BUBBLE) * workers) if schedule_kind(schedule).flush else 1
    return _auto_microbatches(lambda m: _plan_once(profile, model_for(m), workers, keep_timeline), least)


def _chunked(profile: Profile, lay: LayerCosts, topo: Topology, schedule: str, microbatches: int | str, workers: int,
             v: int, optimizer: str, memory: float | None, keep_timeline: bool) -> Planned:
    """Interleaved plans (partitioner/chunks.py): balanced chunks placed round-robin, no replicas."""
    from partitioner.chunks import plan_interleaved, plan_interleaved_auto

    if schedule_kind(schedule).chunk_order is None:
        raise PlanningError(f"--virtual-stages {v} needs --schedule interleaved, found {schedule}")
    kw = {"optimizer": optimizer, "microbatch_size": profile.microbatch_size, "memory_per_worker": memory,
          "keep_timeline": keep_timeline}
    if microbatches == "auto":
        return Planned(*plan_interleaved_auto(lay, topo, schedule, workers, v, bubble=AUTO_BUBBLE,
                                              most=AUTO_MAX_MICROBATCHES, **kw))
    assert isinstance(microbatches, int)
    return Planned(*plan_interleaved(lay, topo, schedule, microbatches, workers, v, **kw))  # type: ignore[arg-type]


def _auto_microbatches(plan_at: Callable[[int], Planned], least: int = 1) -> Planned:
    """--microbatches auto: the smallest power of two up to AUTO_MAX_MICROBATCHES whose plan's simulated
    bubble is at most AUTO_BUBBLE, by binary search from the first power of two >= `least` (tried first:
    usually it is the answer): the bubble shrinks as m grows, memory failures come above some m and
    schedule-rule failures below some m. Failing that, the plan of highest simulated throughput among those
    tried. One to four DP solves instead of up to nine."""
    hi = AUTO_MAX_MICROBATCHES.bit_length() - 1
    lo = min(hi, max(0, (least - 1).bit_length()))
    found: Planned | None = None
    fallback: Planned | None = None
    error: PlanningError | None = None
    first = True
    while lo <= hi:
        mid = lo if first else (lo + hi) // 2
        first = False
        try:
            got = plan_at(1 << mid)
        except PlanningError as e:
            memory = str(e).startswith("no plan fits --memory")
            if error is None or memory:
                error = e
            if memory:
                hi = mid - 1  # memory only grows with m
            else:
                lo = mid + 1  # a schedule rule (async, 2bw) may need more microbatches
            continue
        if got.sim.bubble_fraction <= AUTO_BUBBLE:
            found, hi = got, mid - 1
        else:
            if fallback is None or got.plan.predicted["samples_per_s"] > fallback.plan.predicted["samples_per_s"]:
                fallback = got
            lo = mid + 1
    best = found or fallback
    if best is None:
        assert error is not None
        raise error
    best.plan.extra["planner"]["microbatches_rule"] = (f"smallest power of two <= {AUTO_MAX_MICROBATCHES} with "
                                                       f"simulated bubble <= {AUTO_BUBBLE}")
    return best


def plan_from_profile(profile: Profile, workers: int, *, schedule: str, microbatches: int | str,
                      topology: Topology | str | None = None, memory_per_worker: int | str | None = None,
                      straight: bool = False, optimizer: str = "adam", virtual_stages: int = 1) -> Plan:
    """In-process API for the runtime: the plan for `workers` ranks; raises PlanningError / TopologyError
    (both ValueError) with a one-line message."""
    return plan_detailed(profile, workers, schedule=schedule, microbatches=microbatches, topology=topology,
                         memory_per_worker=memory_per_worker, straight=straight, optimizer=optimizer,
                         virtual_stages=virtual_stages).plan


def evaluate_plan(profile: Profile, plan: Plan, *, topology: Topology | str | None = None,
                  optimizer: str = "adam", keep_timeline: bool = False) -> Planned:
    """Price a given plan (hand-written or from another tool) exactly as the planner prices its own: at the
    microbatch size it was made for (planner.microbatch_size) where the profile holds it, else the profile's."""
    made = plan.extra.get("planner")
    profile = next((p for p in profile.at_sizes() if isinstance(made, dict)
                    and p.microbatch_size == made.get("microbatch_size")), profile)
    topo = resolve_topology(plan.workers, topology, profile)
    check_microbatches(plan.microbatches)
    plan.validate(num_layers=len(profile.layers))
    why = schedule_kind(plan.schedule).violation(plan.microbatches, plan.replicas, plan.warmup)
    lay = replace(layer_costs(priced_as(profile, plan.accumulation), plan.schedule, optimizer),
                  shard_optimizer=plan.shard_optimizer)
    split = [] if schedule_kind(plan.schedule).ties_allowed else lay.ties.across([st.layers for st in plan.stages])
    why = why or (split_tie_error(split[0][0], split[0][2], plan.schedule) if split else None)
    if why:
        raise PlanError(f"the plan cannot run: {why}")
    try:
        costs, sim = price(lay, topo, plan.schedule, plan.microbatches, [st.layers for st in plan.stages],
                           [st.ranks for st in plan.stages], optimizer=optimizer, keep_timeline=keep_timeline,
                           warmup=plan.warmup)
    except ScheduleError as e:  # the replay's grid is for pipeflow-train's log; here the first line
        raise PlanError(f"the plan cannot run: warmup {plan.warmup}: {str(e).splitlines()[0]}") from None
    extra = dict(plan.extra)
    extra["planner"] = {"topology": str(topo), "optimizer": optimizer, "microbatch_size": profile.microbatch_size,
                        "evaluated": True}
    out = Plan(plan.schedule, plan.microbatches, plan.workers, plan.stages,
               predicted(sim, plan.microbatches, profile.microbatch_size), extra)
    return Planned(out, costs, sim)
