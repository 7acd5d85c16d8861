"""`pipeflow-plan`: profile.json -> plan.json via the DP (planner.py), predicted by the simulator (simulate.py).

    pipeflow-plan profile.json --workers 32 --topology 8x300GB/s,4x25GB/s --memory-per-worker 16GiB \\
        --schedule 1f1b --microbatches auto -o plan.json --timeline plan.png
    pipeflow-plan profile.json --evaluate my_plan.json --topology 8x300GB/s,4x25GB/s -o priced.json
    pipeflow-plan profile.json --layers-per-stage 14,12 --microbatches 16 -o split.json   # price a split by hand
    pipeflow-plan profile.json --workers 8 --schedule auto -o plan.json      # the fastest flush schedule

The DP bounds every plan's step time from below; the simulator replays the schedule on the plans in order
of bound until no unvisited plan can be faster, so the plan written is the fastest the simulator knows.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from partitioner.accumulation import gemm_variant, plan_accumulation
from partitioner.auto import AUTO, candidates_table, plan_schedule
from partitioner.batch import global_batch_table, plan_global_batch
from partitioner.inputs import check_microbatches, check_optimizer, check_workers, resolve_topology, virtual_stages
from partitioner.outputs import check_output, same_file
from partitioner.plan import Plan, PlanError, even_plan
from partitioner.planner import OPTIMIZER_STATES, SCHEDULES, PlanningError
from partitioner.profile import Profile, ProfileError
from partitioner.service import Planned, evaluate_plan
from partitioner.timeline import check_format, draw
from partitioner.topology import TopologyError, format_bytes
from pipeflow.kinds import DEFAULT_VIRTUAL_STAGES, schedule_kind
from pipeflow.warmup import least_warmups


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
    """Per stage, per minibatch and replica: compute ms (optimizer step included), communication ms (one
    port's messages, each way the same, + all-reduce)."""
    m = p.plan.microbatches
    rows = [("stage", "layers", "replicas", "ranks", "compute ms", "comm ms", "memory")]
    for s, (st, c) in enumerate(zip(p.plan.stages, p.costs)):
        share = m / st.replicas
        prev_send = p.costs[s - 1].send_ms if s else 0.0
        steps = share if schedule_kind(p.plan.schedule).step_per_backward else 1.0
        rows.append((str(s), f"[{st.layers[0]}, {st.layers[1]})", str(st.replicas), _ranks(st.ranks),
                     f"{share * (c.forward_ms + c.backward_ms) + steps * c.optimizer_ms:.3f}",
                     f"{share * (c.send_ms + prev_send) + steps * c.allreduce_ms:.3f}",
                     format_bytes(p.sim.peak_memory_bytes[s])))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    pr = p.plan.predicted
    lines.append(f"schedule {p.plan.schedule}, {m} microbatches, {p.plan.workers} workers "
                 f"({p.plan.extra['planner']['topology']}): step {pr['step_ms']:.3f} ms, "
                 f"{pr['samples_per_s']:.1f} samples/s, bubble {100 * pr['bubble_fraction']:.1f}%")
    if p.plan.warmup is not None:
        least = least_warmups(p.plan.replicas)
        lines.append(f"warm-up: {', '.join(map(str, p.plan.warmup))} forwards before the first backward per stage "
                     f"(the schedule's minimum: {', '.join(map(str, least))}; the extra ones hide the round trips)")
    if p.plan.accumulation == "gemm":
        lines.append("accumulation: gemm (each nn.Linear adds its weight gradient inside the GEMM, priced with the "
                     "profile's gemm times; PIPEFLOW_GRAD_ACCUM=autograd overrides it)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipeflow-plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="profile.json from pipeflow-profile")
    p.add_argument("--workers", type=int, default=None, help="ranks to plan for (with --evaluate: the plan's)")
    p.add_argument("--topology", default=None,
                   help="levels COUNTxBANDWIDTH, innermost first, e.g. 8x300GB/s,4x25GB/s (default: one level "
                        "of all workers at the profile's measured GPU-to-GPU bandwidth, else 10GB/s)")
    p.add_argument("--memory-per-worker", default=None, help="bytes, e.g. 16GB, 16GiB, 1e9")
    p.add_argument("--schedule", choices=(*SCHEDULES, AUTO), default=None,
                   help="default 1f1b (--evaluate: the plan's); auto: the flush schedule of highest predicted "
                        "throughput under the memory limit, with the table of candidates")
    p.add_argument("--microbatches", default=None, help="m, or auto (default; --evaluate: the plan's)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step G: choose the microbatch size b (among the profile's sizes) and m = G / b")
    p.add_argument("--straight", action="store_true", help="no replicated stages")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="--schedule interleaved: model chunks per rank, placed round-robin (default "
                        f"{DEFAULT_VIRTUAL_STAGES}; --evaluate: the plan's); "
                        "--microbatches must be a multiple of --workers")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATES), default="adam")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="price replicated stages with their optimizer state split over the replicas (1/r of it and "
                        "of the update each, then the weights broadcast), as pipeflow-train --shard-optimizer runs "
                        "them; the plan says so and pipeflow-train follows it")
    p.add_argument("--evaluate", metavar="PLAN", default=None,
                   help="price this plan.json instead of planning: write it to -o with 'predicted' filled")
    p.add_argument("--layers-per-stage", metavar="COUNTS", default=None,
                   help="price one straight plan instead of planning, as pipeflow-train --layers-per-stage runs "
                        "it: layer counts per stage, e.g. 14,12 (a rank each; with interleaved, --virtual-stages "
                        "chunks per rank, round-robin), or 'even' with --workers; needs --microbatches M")
    p.add_argument("-o", "--output", required=True, help="plan.json to write")
    p.add_argument("--timeline", default=None,
                   help="draw the simulated schedule to this PNG (or .pdf, .svg: a format matplotlib writes)")
    return p.parse_args(argv)


def _microbatches(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise PlanningError(f"--microbatches must be a positive integer or 'auto', found {text!r}")
    m = int(text)
    check_microbatches(m)
    return m


def _check_paths(args: argparse.Namespace) -> None:
    """-o and --timeline before anything is read or planned: files that can be written, neither an input nor
    each other (--evaluate X -o X prices the plan in place: allowed)."""
    check_output(args.output, "-o", PlanningError)
    if same_file(args.output, args.profile):
        raise PlanningError(f"-o {args.output} is the profile pipeflow-plan reads: the plan would overwrite it; "
                            "write the plan to another file")
    if args.timeline is None:
        return
    check_output(args.timeline, "--timeline", PlanningError)
    for other, what in ((args.output, "the plan -o writes"), (args.profile, "the profile pipeflow-plan reads"),
                        (args.evaluate, "the plan --evaluate reads")):
        if other is not None and same_file(args.timeline, other):
            raise PlanningError(f"--timeline {args.timeline} is {what}: the drawing would overwrite it; draw to "
                                "another file")
    check_format(args.timeline)


def _evaluate(args: argparse.Namespace, profile: Profile) -> Planned:
    plan = Plan.load(args.evaluate)
    check_workers(plan.workers, f"{args.evaluate}: plan.workers")  # the planner's limits, named as the file has them
    check_microbatches(plan.microbatches, f"{args.evaluate}: plan.microbatches")
    if args.shard_optimizer:
        plan.extra["shard_optimizer"] = True
    if args.virtual_stages is not None:
        virtual_stages(args.virtual_stages, plan.schedule)
    m = None if args.microbatches is None else _microbatches(args.microbatches)  # 08 is 8
    for flag, given, own in (("--workers", args.workers, plan.workers), ("--schedule", args.schedule, plan.schedule),
                             ("--microbatches", m, plan.microbatches),
                             ("--virtual-stages", args.virtual_stages, plan.virtual_stages)):
        if given is not None and given != own:
            raise PlanError(f"{flag} {given} differs from the plan's {own} ({args.evaluate}); drop {flag} "
                            "to evaluate the plan as written")
    if args.global_batch is not None:
        raise PlanError("--global-batch shapes a search; --evaluate prices the plan as written")
    if args.memory_per_worker is not None or args.straight:
        raise PlanError("--memory-per-worker and --straight shape a search; --evaluate prices the plan as written")
    if plan.accumulation == "gemm" and gemm_variant(profile) is None:
        print(f"pipeflow-plan: warning: {args.evaluate} accumulates in the GEMMs but the profile has no gemm times "
              "(*_gemm_ms): priced with its own, right if it was profiled under PIPEFLOW_GRAD_ACCUM=gemm",
              file=sys.stderr)
    return evaluate_plan(profile, plan, topology=args.topology, optimizer=args.optimizer,
                         keep_timeline=args.timeline is not None)


def _split(args: argparse.Namespace, profile: Profile) -> Planned:
    """--layers-per-stage: the straight plan pipeflow-train --layers-per-stage runs, priced as the planner prices
    its own (with gemm accumulation where the profile timed it and it is faster: plan.json's `accumulation`)."""
    if args.global_batch is not None or args.memory_per_worker is not None or args.straight:
        raise PlanError("--global-batch, --memory-per-worker and --straight shape a search; --layers-per-stage "
                        "prices the split as given")
    if args.schedule == AUTO:
        raise PlanError("--schedule auto compares schedules; --layers-per-stage prices one: name it")
    if args.microbatches in (None, "auto"):
        raise PlanError("--layers-per-stage prices one plan: give --microbatches M")
    m = _microbatches(args.microbatches)
    assert isinstance(m, int)  # "auto" refused above
    schedule, v = args.schedule or "1f1b", args.virtual_stages
    counts, workers = None, args.workers
    if workers is not None:
        check_workers(workers)
    if args.layers_per_stage != "even":
        try:
            counts = [int(x) for x in args.layers_per_stage.split(",")]
        except ValueError:
            raise PlanError("--layers-per-stage must be comma-separated integers or 'even', found "
                            f"{args.layers_per_stage!r}") from None
        if len(counts) % v:
            raise PlanError(f"--layers-per-stage gives {len(counts)} stages, not a multiple of --virtual-stages {v}")
        if workers is not None and len(counts) != workers * v:
            chunks = f" x --virtual-stages {v}" if v > 1 else ""
            raise PlanError(f"--layers-per-stage gives {len(counts)} stages but --workers {workers}{chunks} makes "
                            f"{workers * v}")
        workers = len(counts) // v
    elif workers is None:
        raise PlanError("--layers-per-stage even needs --workers")
    plan = even_plan(len(profile.layers), workers, schedule=schedule, microbatches=m, layer_counts=counts,
                     virtual_stages=v)
    return plan_accumulation(lambda prof: evaluate_plan(prof, plan, topology=args.topology, optimizer=args.optimizer,
                                                        keep_timeline=args.timeline is not None), profile)


def _draw(planned: Planned, path: str) -> str | None:
    """Draw the timeline to `path`; None, or the first line of why matplotlib could not."""
    try:
        draw(planned, path)
    except (ValueError, RuntimeError, OSError) as e:
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        _check_paths(args)
        if args.evaluate is not None and args.layers_per_stage is not None:
            raise PlanningError("give one of --evaluate PLAN and --layers-per-stage COUNTS")
        if args.evaluate is None:
            args.virtual_stages = virtual_stages(args.virtual_stages, args.schedule or "1f1b")
        if args.evaluate is None and args.layers_per_stage is None:
            if args.workers is None:
                raise PlanningError("--workers is required (or --evaluate PLAN)")
            if args.global_batch is not None and args.microbatches is not None:
                raise PlanningError("--global-batch chooses the microbatch count; drop --microbatches")
            mb = _microbatches(args.microbatches or "auto")
            resolve_topology(args.workers, None)  # refuse sizes before reading anything
        profile = Profile.load(args.profile)
        check_optimizer(profile, args.optimizer, args.profile)  # before planning: else priced at 0
        if args.evaluate is not None:
            planned = _evaluate(args, profile)
        elif args.layers_per_stage is not None:
            planned = _split(args, profile)
        else:
            common = dict(topology=args.topology, memory_per_worker=args.memory_per_worker, straight=args.straight,
                          optimizer=args.optimizer, keep_timeline=args.timeline is not None,
                          shard_optimizer=args.shard_optimizer)
            if args.schedule not in (None, AUTO) and schedule_kind(args.schedule).chunk_order is not None:
                common["virtual_stages"] = args.virtual_stages
            if args.global_batch is not None:
                planned = plan_global_batch(profile, args.workers, global_batch=args.global_batch,
                                            schedule=args.schedule or "1f1b", **common)
            else:
                planned = plan_schedule(profile, args.workers, schedule=args.schedule or "1f1b", microbatches=mb,
                                        **common)
        planned.plan.save(args.output)  # before the drawing: a drawing that fails loses no plan
    except (PlanningError, TopologyError, ProfileError, PlanError, OSError) as e:
        print(f"pipeflow-plan: error: {e}", file=sys.stderr)
        return 2
    for text in (global_batch_table(planned), candidates_table(planned)):
        if text:
            print(text)
    print(table(planned))
    failed = None if args.timeline is None else _draw(planned, args.timeline)
    print(f"wrote {args.output}" + (f" and {args.timeline}" if args.timeline is not None and failed is None else ""))
    if failed is not None:
        print(f"pipeflow-plan: error: wrote {args.output} but could not draw --timeline {args.timeline}: {failed}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
