"""`pipeflow-plan`: profile.json -> plan.json via the DP (planner.py), predicted by the simulator (simulate.py).

    pipeflow-plan profile.json --workers 32 --topology 8x300GB/s,4x25GB/s --memory-per-worker 16GiB \\
        --schedule 1f1b --microbatches auto -o plan.json --timeline plan.png
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.plan import Plan, PlanError, StagePlan
from partitioner.planner import OPTIMIZER_STATES, SCHEDULES, CostModel, LayerCosts, PlanningError, Solution, solve
from partitioner.profile import Profile, ProfileError
from partitioner.simulate import SimResult, StageCost, simulate
from partitioner.topology import Topology, TopologyError, format_bytes, parse_bytes

# --microbatches auto: the smallest power of two up to AUTO_MAX_MICROBATCHES whose simulated bubble (share
# of worker time not computing, all-reduce waits included) is at most AUTO_BUBBLE; failing that, the
# candidate with the highest simulated throughput. More microbatches shrink the fill/drain bubble,
# (S-1)/(m+S-1) for 1F1B, but cost activation memory (gpipe) and a larger minibatch.
AUTO_BUBBLE = 0.10
AUTO_MAX_MICROBATCHES = 256


@dataclass
class Planned:
    """The plan with what the table and the timeline need."""

    plan: Plan
    solution: Solution
    costs: list[StageCost]
    sim: SimResult


def stage_costs(model: CostModel, solution: Solution) -> list[StageCost]:
    """Per flattened stage: compute, sends at the bandwidth of the level its output boundary crosses, and a
    hierarchical all-reduce (one ring per level its replicas span)."""
    lay = model.layers
    out = []
    for t, st in enumerate(solution.stages):
        a, b = st.start, st.end
        p = float(lay.parameter_bytes[a:b].sum())
        nxt = solution.stages[t + 1].in_level if t + 1 < len(solution.stages) else None
        send = 0.0 if nxt is None else float(lay.output_bytes[b - 1]) / model.bw(nxt)
        ar = sum(float(model.allreduce_ms(p, f, lv)) for lv, f in enumerate(st.factors) if f > 1)
        out.append(StageCost(float(lay.forward_ms[a:b].sum()), float(lay.backward_ms[a:b].sum()), send, ar, p,
                             float(lay.activation_bytes[a:b].sum())))
    return out


def _explain(model: CostModel, workers: int) -> PlanningError:
    """Why no plan exists: structure (too few layers for --straight) or memory (name the stage)."""
    limit = model.memory_per_worker
    model.memory_per_worker = None
    try:
        sol = solve(model)
    except PlanningError:
        return PlanningError(f"cannot place {workers} workers on {model.num_layers} layers with --straight: "
                             f"every stage needs at least one layer; use fewer workers or allow replication")
    finally:
        model.memory_per_worker = limit
    costs = stage_costs(model, sol)
    sim = simulate(model.schedule, costs, [len(s.ranks) for s in sol.stages], model.microbatches,
                   optimizer=model.optimizer)
    s = max(range(len(costs)), key=lambda k: sim.peak_memory_bytes[k])
    st, need, fl = sol.stages[s], sim.peak_memory_bytes[s], sim.peak_in_flight[s]
    act = fl * costs[s].activation_bytes
    return PlanningError(
        f"no plan fits --memory-per-worker {format_bytes(limit or 0)}: even the fastest plan's stage {s} "
        f"(layers [{st.start}, {st.end}), {len(st.ranks)} replica(s)) needs {format_bytes(need)} "
        f"(weights, gradients, optimizer state {format_bytes(need - act)} + activations of {fl} microbatch(es) "
        f"{format_bytes(act)}); use more workers, sgd, fewer microbatches or --schedule 1f1b")


def _plan_once(profile: Profile, model: CostModel, workers: int, keep_timeline: bool) -> Planned:
    try:
        sol = solve(model)
    except PlanningError:
        raise _explain(model, workers) from None
    costs = stage_costs(model, sol)
    sim = simulate(model.schedule, costs, [len(s.ranks) for s in sol.stages], model.microbatches,
                   optimizer=model.optimizer, keep_timeline=keep_timeline)
    m = model.microbatches
    step_s = sim.step_ms / 1e3
    predicted = {"step_ms": round(sim.step_ms, 6),
                 "samples_per_s": round(m * profile.microbatch_size / step_s, 3) if step_s > 0 else 0.0,
                 "bubble_fraction": round(sim.bubble_fraction, 6),
                 "peak_memory_bytes": [float(x) for x in sim.peak_memory_bytes]}
    stages = [StagePlan((s.start, s.end), len(s.ranks), sorted(s.ranks)) for s in sol.stages]
    extra = {"planner": {"topology": str(model.topology), "optimizer": model.optimizer,
                         "objective_ms": round(sol.objective_ms, 6), "microbatch_size": profile.microbatch_size}}
    plan = Plan(model.schedule, m, workers, stages, predicted, extra)
    return Planned(plan, sol, costs, sim)


def plan_detailed(profile: Profile, workers: int, *, schedule: str = "1f1b", microbatches: int | str = "auto",
                  topology: Topology | str | None = None, memory_per_worker: int | str | None = None,
                  straight: bool = False, optimizer: str = "adam", keep_timeline: bool = False) -> Planned:
    if not isinstance(workers, int) or workers < 1:
        raise PlanningError(f"--workers must be a positive integer, found {workers!r}")
    if isinstance(topology, str):
        topology = Topology.parse(topology, workers)
    topology = topology or Topology.default(workers)
    if topology.workers != workers:
        raise TopologyError(f"--workers {workers} does not match the topology {topology} "
                            f"({topology.workers} workers)")
    if isinstance(memory_per_worker, str):
        memory_per_worker = parse_bytes(memory_per_worker)
    lay = LayerCosts.of(*(profile.column(k) for k in ("forward_ms", "backward_ms", "output_bytes",
                                                       "activation_bytes", "parameter_bytes")))

    def model_for(m: int) -> CostModel:
        return CostModel(lay, topology, schedule, m, optimizer,
                         None if memory_per_worker is None else float(memory_per_worker), straight)

    if microbatches != "auto":
        if not isinstance(microbatches, int) or isinstance(microbatches, bool):
            raise PlanningError(f"--microbatches must be a positive integer or 'auto', found {microbatches!r}")
        return _plan_once(profile, model_for(microbatches), workers, keep_timeline)
    best: Planned | None = None
    m = 1
    while m <= AUTO_MAX_MICROBATCHES:
        try:
            got = _plan_once(profile, model_for(m), workers, keep_timeline)
        except PlanningError:
            if best is None:
                raise
            break  # memory only grows with m
        if best is None or got.plan.predicted["samples_per_s"] > best.plan.predicted["samples_per_s"]:
            best = got
        if got.sim.bubble_fraction <= AUTO_BUBBLE:
            best = got
            break
        m *= 2
    assert best is not None
    best.plan.extra["planner"]["microbatches_rule"] = (f"smallest power of two <= {AUTO_MAX_MICROBATCHES} with "
                                                       f"simulated bubble <= {AUTO_BUBBLE}")
    return best


def plan_from_profile(profile: Profile, workers: int, *, schedule: str, microbatches: int | str,
                      topology: Topology | str | None = None, memory_per_worker: int | str | None = None,
                      straight: bool = False, optimizer: str = "adam") -> Plan:
    """In-process API for the runtime: the plan for `workers` ranks; raises PlanningError / TopologyError
    (both ValueError) with a one-line message."""
    return plan_detailed(profile, workers, schedule=schedule, microbatches=microbatches, topology=topology,
                         memory_per_worker=memory_per_worker, straight=straight, optimizer=optimizer).plan


def _ranks(ranks: Sequence[int]) -> str:
    rs, parts, i = sorted(ranks), [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(parts)


def table(p: Planned) -> str:
    """Per stage, per minibatch and replica: compute ms, communication ms (sends both ways + all-reduce)."""
    m = p.plan.microbatches
    rows = [("stage", "layers", "replicas", "ranks", "compute ms", "comm ms", "memory")]
    for s, (st, c) in enumerate(zip(p.plan.stages, p.costs)):
        share = m / st.replicas
        prev_send = p.costs[s - 1].send_ms if s else 0.0
        rows.append((str(s), f"[{st.layers[0]}, {st.layers[1]})", str(st.replicas), _ranks(st.ranks),
                     f"{share * (c.forward_ms + c.backward_ms):.3f}",
                     f"{share * 2 * (c.send_ms + prev_send) + c.allreduce_ms:.3f}",
                     format_bytes(p.sim.peak_memory_bytes[s])))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    pr = p.plan.predicted
    lines.append(f"schedule {p.plan.schedule}, {m} microbatches, {p.plan.workers} workers "
                 f"({p.plan.extra['planner']['topology']}): step {pr['step_ms']:.3f} ms, "
                 f"{pr['samples_per_s']:.1f} samples/s, bubble {100 * pr['bubble_fraction']:.1f}%")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipeflow-plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="profile.json from pipeflow-profile")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--topology", default=None,
                   help="levels COUNTxBANDWIDTH, innermost first, e.g. 8x300GB/s,4x25GB/s (default: one level "
                        "of all workers at 10GB/s)")
    p.add_argument("--memory-per-worker", default=None, help="bytes, e.g. 16GB, 16GiB, 1e9")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--microbatches", default="auto", help="m, or auto (default)")
    p.add_argument("--straight", action="store_true", help="no replicated stages")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATES), default="adam")
    p.add_argument("-o", "--output", required=True, help="plan.json to write")
    p.add_argument("--timeline", default=None, help="draw the simulated schedule to this PNG")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        mb: int | str = args.microbatches
        if mb != "auto":
            if not str(mb).isdigit() or int(mb) < 1:
                raise PlanningError(f"--microbatches must be a positive integer or 'auto', found {mb!r}")
            mb = int(mb)
        profile = Profile.load(args.profile)
        planned = plan_detailed(profile, args.workers, schedule=args.schedule, microbatches=mb,
                                topology=args.topology, memory_per_worker=args.memory_per_worker,
                                straight=args.straight, optimizer=args.optimizer,
                                keep_timeline=args.timeline is not None)
        if args.timeline:
            from partitioner.timeline import draw
            draw(planned, args.timeline)
        planned.plan.save(args.output)
    except (PlanningError, TopologyError, ProfileError, PlanError, OSError) as e:
        print(f"pipeflow-plan: error: {e}", file=sys.stderr)
        return 2
    print(table(planned))
    print(f"wrote {args.output}" + (f" and {args.timeline}" if args.timeline else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
