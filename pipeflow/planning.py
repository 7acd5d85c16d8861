"""Where a run's plan comes from: --plan, an even or explicit split, or profiling and planning on the spot
(through the planning service, partitioner/service.py); and the checks of a plan against the flags."""
from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from typing import Any

import torch

from partitioner.costmodel import PlanningError
from partitioner.inputs import virtual_stages as checked_virtual_stages
from partitioner.plan import Plan, PlanError
from pipeflow.config import TrainConfig
from pipeflow.failure import UsageError
from pipeflow.kinds import WARMUP_SCHEDULES, schedule_kind
from pipeflow.spec import ModelSpec

log = logging.getLogger("pipeflow")
GPU_SHARE = 0.9  # of a GPU's memory that a plan made on the spot may fill (spot_memory)


def make_plan(args: TrainConfig, spec: ModelSpec, world_size: int, rank: int, mpi: Any) -> Plan:
    """The plan from --plan; an even or explicit split (--layers-per-stage); otherwise rank 0 profiles
    the layers and runs the planner for this many workers, and every rank gets its plan."""
    plan = _make_plan(args, spec, world_size, rank, mpi)
    # checked here, before any process group: one line, exit 2 (with the warm-up that will run: --warmup's
    # counts, else the plan's; 2bw's replicas need a share of each minibatch that covers it)
    counts = resolve_warmup(args.warmup, plan)
    why = schedule_kind(plan.schedule).violation(plan.microbatches, plan.replicas,
                                                 counts if counts is not None else plan.warmup)
    if why:
        raise UsageError(why)
    return plan


def virtual_stages(args: TrainConfig, schedule: str | None = None) -> int:
    """--virtual-stages, or the default of the schedule: 2 where chunks are placed round-robin, else 1; checked as
    pipeflow-plan checks it (partitioner.inputs.virtual_stages)."""
    name = schedule_kind(schedule or args.schedule or "1f1b").name  # an unknown name: ScheduleError, as before
    try:
        return checked_virtual_stages(args.virtual_stages, name)
    except PlanningError as e:
        raise UsageError(str(e)) from None


def check_planning_flags(args: TrainConfig, world_size: int) -> None:
    """The flags that shape planning on the spot, before any profiling: refused with --plan or --layers-per-stage,
    which plan nothing (they would be ignored), and --topology and --memory-per-worker parsed as the planner will."""
    from partitioner.topology import Topology, parse_bytes

    gb = args.global_batch
    if gb is not None:
        if gb < 1:
            raise UsageError(f"--global-batch must be >= 1, found {gb}")
        if args.plan is not None or args.layers_per_stage is not None or args.microbatches is not None:
            raise UsageError("--global-batch chooses the microbatch size and count when planning on the spot; "
                             "drop --plan, --layers-per-stage and --microbatches")
        if args.microbatch_size and gb % args.microbatch_size:  # 0: the planner chooses
            raise UsageError(f"--global-batch {gb} is not a multiple of --microbatch-size {args.microbatch_size}: "
                             f"a step is microbatch size x microbatches; pass a multiple of {args.microbatch_size}, "
                             "or drop --microbatch-size to let the planner choose it")
    shaping = [flag for flag, given in (("--topology", args.topology is not None), ("--straight", args.straight),
                                        ("--memory-per-worker", args.memory_per_worker is not None)) if given]
    if args.plan is not None and (shaping or args.layers_per_stage is not None):
        flag = shaping[0] if shaping else "--layers-per-stage"
        raise UsageError(f"{flag} applies when planning on the spot, but --plan {args.plan} gives the plan, which "
                         f"would run as it is; drop {flag} (or pass it to pipeflow-plan and plan again)")
    if args.layers_per_stage is not None and shaping:
        raise UsageError(f"{shaping[0]} applies when planning on the spot, but --layers-per-stage "
                         f"{args.layers_per_stage} splits the layers by hand, which would run as it is; drop "
                         f"{shaping[0]} (or --layers-per-stage to plan on the spot)")
    try:
        if args.topology is not None:
            topology = Topology.parse(args.topology)
            if topology.workers != world_size:
                raise UsageError(f"--topology {args.topology} has {topology.workers} workers, but -np is {world_size}; "
                                 f"give levels whose counts multiply to {world_size}")
        if args.memory_per_worker is not None:
            parse_bytes(args.memory_per_worker)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _make_plan(args: TrainConfig, spec: ModelSpec, world_size: int, rank: int, mpi: Any) -> Plan:
    n = len(spec.layers)
    check_planning_flags(args, world_size)
    if args.plan is not None:
        plan = Plan.load(args.plan)
        plan.validate(num_layers=n, world_size=world_size)
        if args.microbatches is not None:
            plan.microbatches = args.microbatches
        if args.schedule is not None:
            try:  # a plan placing chunks round-robin needs a schedule that runs them
                plan.set_schedule(args.schedule)
            except PlanError as e:
                raise PlanError(f"{args.plan}: {e}") from None
        v = virtual_stages(args, plan.schedule)
        if args.virtual_stages is not None and v != plan.virtual_stages:
            raise UsageError(f"--virtual-stages {v} but {args.plan} places {plan.virtual_stages} stage(s) on each "
                             "rank group; drop the flag or plan again")
        return plan
    from partitioner.plan import even_plan

    v = virtual_stages(args)
    if args.layers_per_stage is None:
        return plan_on_the_spot(args, spec, world_size, rank, mpi, v)
    counts = None
    if args.layers_per_stage != "even":
        try:
            counts = [int(x) for x in args.layers_per_stage.split(",")]
        except ValueError:
            raise UsageError(f"--layers-per-stage must be comma-separated integers, found {args.layers_per_stage!r}"
                             ) from None
        if len(counts) != world_size * v:
            more = f" x --virtual-stages {v}" if v > 1 else ""
            raise UsageError(f"--layers-per-stage gives {len(counts)} stages but -np is {world_size}{more}")
    return even_plan(n, world_size, schedule=args.schedule or "1f1b", microbatches=args.microbatches or 8,
                     layer_counts=counts, virtual_stages=v)


def plan_on_the_spot(args: TrainConfig, spec: ModelSpec, world_size: int, rank: int, mpi: Any,
                     virtual: int = 1) -> Plan:
    result: tuple[str, Any] = ("error", "rank 0 did not plan")
    hosts = mpi.allgather(socket.gethostname())  # every rank, before rank 0 plans: the busiest host
    if rank == 0:
        limit_from = ""
        try:
            from partitioner.auto import AUTO, candidates_table, plan_schedule
            from partitioner.batch import global_batch_table, plan_global_batch
            from partitioner.profiler import profile_model
            from pipeflow.graphcheck import graphs_enabled

            device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            limit, limit_from = spot_memory(args, device, max(Counter(hosts).values()))
            t0 = time.perf_counter()
            # In this rank's own thread count (what training runs with); the loss and --optimizer's step timed.
            notes: list[str] = []
            gb = args.global_batch
            sizes = [args.microbatch_size] if gb is None or args.microbatch_size else \
                [b for b in (64, 32, 16, 8, 4, 2, 1) if gb % b == 0][:4]
            profile, *others = [profile_model(spec, b, device, dtype=args.dtype, warmup=1, repeats=3, seed=args.seed,
                                              optimizer=args.optimizer, warnings=notes) for b in sizes]
            profile.others = others
            forget_profiling(device, max((p.device_peak_bytes or 0 for p in (profile, *others)), default=0))
            for note in notes:
                log.warning("profiling on the spot: %s", note)
            # Without --schedule: the fastest flush schedule (--schedule auto), all equal to single-process training;
            # under PIPEFLOW_CUDA_GRAPHS=1, 1f1b (graphs.py replays gpipe's and 1f1b's actions).
            common: dict[str, Any] = dict(schedule=args.schedule or ("1f1b" if graphs_enabled() else AUTO),
                                          topology=args.topology, straight=args.straight, optimizer=args.optimizer,
                                          memory_per_worker=limit, shard_optimizer=args.shard_optimizer)
            if virtual > 1:  # --schedule interleaved: chunks per rank
                common["virtual_stages"] = virtual
            if gb is None:
                planned = plan_schedule(profile, world_size, microbatches=args.microbatches or 8, **common)
            else:
                planned = plan_global_batch(profile, world_size, global_batch=gb, **common)
                log.info("%s", global_batch_table(planned))
            plan = planned.plan
            if args.schedule is None:
                log.info("%s", candidates_table(planned))
            log.info("profiled %d layers on %s in %s and planned for %d workers in %.1f s (no --plan given); "
                     "predicted %s", len(spec.layers), device, profile.dtype, world_size, time.perf_counter() - t0,
                     {k: v for k, v in plan.predicted.items() if k != "peak_memory_bytes"})
            result = ("plan", plan.to_json())
        except (ValueError, RuntimeError) as e:
            result = ("error", f"planning on the spot failed: {e}" + (f" (the limit is {limit_from}; "
                      "--memory-per-worker sets another)" if limit_from and "memory-per-worker" in str(e) else ""))
    kind, value = mpi.bcast(result, root=0)
    if kind == "error":
        raise UsageError(value)
    return Plan.from_json(value, source="the plan made on the spot")


def forget_profiling(device: str, peak: int = 0) -> None:
    """After profiling on the spot on a GPU: the peak memory training reports (runner.py) must be training's,
    not the profile's (`--timing stage` runs the whole model's chain on rank 0), nor the profile's cached blocks
    held. Logs the profile's own peak, then frees and resets. (Rank 0's 17.39 GiB for a 13.82 GiB training on 2
    H100s, and 32.59 for 25.07 on 2 H200s, were tensors the profiler leaked, not its peak: partitioner/layermem.py.)
    `peak`: the profiles' own record of it (the loss's memory measurement resets CUDA's statistic midway)."""
    if device != "cuda":
        return
    log.info("profiling on the spot peaked at %.2f GiB of this GPU (not in training's peak below)",
             max(peak, torch.cuda.max_memory_allocated()) / 2**30)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def spot_memory(args: TrainConfig, device: str, local_ranks: int) -> tuple[str | int, str]:
    """The memory per worker a plan made on the spot must fit, and where it comes from ("" for the flag):
    --memory-per-worker, else on CUDA this GPU's memory and on CPU this host's RAM shared by its ranks
    (`local_ranks`: the most any host runs). Without a limit the planner could replicate a stage that cannot
    fit (a 10 B-parameter model on every 80 GB GPU) and training would run out of memory instead."""
    if args.memory_per_worker is not None:
        return args.memory_per_worker, ""
    from partitioner.measure import machine_bytes

    total, where = machine_bytes(torch.device(device))
    cuda = device.startswith("cuda")
    # The planner's peak counts tensors; on a GPU the CUDA context, NCCL's buffers and the caching allocator's
    # slack come on top: leave them a tenth.
    limit = int(GPU_SHARE * total) if cuda else total // max(1, local_ranks)
    source = f"{where}, {total / 2**30:.1f} GiB" + (f", {GPU_SHARE:.0%} of it" if cuda else
                                                    f", shared by its {local_ranks} ranks")
    log.info("planning on the spot under %.2f GiB per worker (%s; --memory-per-worker sets another)",
             limit / 2**30, source)
    return limit, source


def resolve_warmup(text: str, plan: Plan) -> list[int] | None:
    """--warmup as per-stage counts, or None for the plan's (pipeflow-plan's choice, else DAPPLE's minimum)."""
    from pipeflow.schedule import fill_warmup
    from pipeflow.warmup import least_warmups

    if text == "plan":
        return None
    if text == "min":
        return least_warmups(plan.replicas) if plan.warmup else None
    if not schedule_kind(plan.schedule).warmup_applies:
        raise UsageError(f"--warmup {text} applies to --schedule {WARMUP_SCHEDULES} only, found {plan.schedule}")
    if text == "fill":
        return [fill_warmup(plan.replicas, s) for s in range(len(plan.stages))]
    counts = [int(x) for x in text.split(",")]
    if len(counts) != len(plan.stages):
        raise UsageError(f"--warmup gives {len(counts)} counts but the plan has {len(plan.stages)} stages")
    return counts


def check_model_on_plan(spec: ModelSpec, plan: Plan, device: str) -> None:
    """What the plan's schedule cannot run of this model, refused before any work: a Parameter shared by layers of
    several stages trains as one under gpipe and 1f1b (engine.py), but the asynchronous schedules would give its
    copies different weight versions; and what PIPEFLOW_CUDA_GRAPHS=1 cannot replay (graphs.py). `device`: --device."""
    from pipeflow.graphcheck import check_graphs
    from pipeflow.links import tied_async_error
    from pipeflow.reduce import find_ties

    if not schedule_kind(plan.schedule).ties_allowed:
        ties = find_ties(spec.layers, [st.layers for st in plan.stages], [st.ranks for st in plan.stages])
        if ties:
            raise UsageError(tied_async_error(ties, plan.schedule))
    check_graphs(spec.layers, plan, device)


def replicated_statistics(spec: ModelSpec, plan: Plan) -> str | None:
    """The warning for running statistics (BatchNorm's mean and variance) in a replicated stage: each replica
    updates its own from its share of the microbatches, as DDP without SyncBatchNorm, and --save, checkpoints and
    Pipeline.state_dict keep replica 0's; None where no replicated stage holds any."""
    for k, st in enumerate(plan.stages):
        if st.replicas < 2:
            continue
        names = [f"{i}.{n}" if n else str(i) for i in range(*st.layers) for n, m in spec.layers[i].named_modules()
                 if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats]
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            return (f"stage {k} (layers [{st.layers[0]}, {st.layers[1]})) runs on {st.replicas} replicas and keeps "
                    f"running statistics ({shown}): each replica updates its own from its share of the "
                    f"microbatches, as DDP without SyncBatchNorm, and the saved model and checkpoints keep replica "
                    f"0's; the parameters train as in one process, those buffers do not (plan the stage unreplicated "
                    f"to keep them too)")
    return None
