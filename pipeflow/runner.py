"""The training loop of one run: world, monitor, engine and supervisor made, steps run, the model saved."""
from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

import torch

from partitioner.plan import Plan
from pipeflow.planning import resolve_warmup
from pipeflow.spec import ModelSpec

log = logging.getLogger("pipeflow")

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def make_optimizer(args: argparse.Namespace) -> Any:
    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if args.optimizer == "sgd":
            return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
        cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.AdamW
        fused = bool(params) and all(p.is_cuda for p in params)  # one kernel per step on GPUs
        return cls(params, lr=args.lr, weight_decay=args.weight_decay, fused=fused or None)
    return factory


def run(args: argparse.Namespace, spec: ModelSpec, plan: Plan, comm: Any) -> int:
    from pipeflow.checkpoint import run_info
    from pipeflow.comm import init_world, shutdown
    from pipeflow.data.loader import MicrobatchLoader
    from pipeflow.engine import Engine
    from pipeflow.monitor import Monitor
    from pipeflow.supervisor import Supervisor

    world = init_world(device=args.device, timeout_s=args.timeout)
    # mpirun (MPICH's) reports a killed process by its pid and ends the job before any rank can speak:
    # this line is what maps that pid back to a rank.
    pids = comm.gather((os.uname().nodename, os.getpid()), root=0)
    if world.rank == 0:
        log.info("processes by rank: %s", ", ".join(f"{r}={h}:{p}" for r, (h, p) in enumerate(pids)))
        log.info("plan: %s, %d microbatches of %d, stages %s", plan.schedule, plan.microbatches,
                 args.microbatch_size, [(list(st.layers), st.ranks) for st in plan.stages])
    loader = MicrobatchLoader(spec.dataset, args.microbatch_size, seed=args.seed, shuffle=not args.no_shuffle)
    m = plan.microbatches
    monitor = Monitor(comm, plan, world.device, total_steps=args.steps, samples_per_step=m * args.microbatch_size,
                      tokens_per_sample=spec.tokens_per_sample, tensorboard=args.tensorboard, trace=args.trace,
                      config=vars(args))
    engine = Engine(world, plan, spec, schedule=plan.schedule, optimizer_factory=make_optimizer(args),
                    warmup=resolve_warmup(args.warmup, plan),
                    loader=loader, dtype=DTYPES[args.dtype] if args.dtype else None, total_steps=args.steps,
                    timer=monitor.timer, vertical_sync=args.vertical_sync, seed=args.seed,
                    segment_steps=(min(args.checkpoint_every, args.steps) or None) if args.checkpoint_dir else None)
    info = run_info(args, spec, plan)
    # This rank keeps only its own stage's layers (engine.stage): drop the model-wide list so that the
    # other stages' layers are freed (issue 10, item 3).
    spec.layers = []
    # Resume, checkpoints, signals and non-finite checks at step boundaries (supervisor.py, checkpoint.py).
    supervisor = Supervisor(args, engine, comm, info)
    start = supervisor.start()
    every = args.log_every or max(1, args.steps // 10)
    last_reported = start
    first_report: tuple[int, float] | None = None  # (step, time) of the first report: steady state after it

    def report(k: int) -> None:
        nonlocal last_reported, first_report
        step = k + 1
        monitor.end_step(k)
        if step % every == 0 or step == args.steps:
            loss = engine.take_loss((step - last_reported) * m)
            last_reported = step
            if first_report is None:
                first_report = (step, time.perf_counter())
            monitor.report(step, loss, lr=engine.optimizer.param_groups[0]["lr"])
        supervisor.after_step(step)

    monitor.start(start)
    if engine.flush:
        for k in range(start, args.steps):
            engine.train_step(k)
            report(k)
    else:  # segments that fill and drain the pipeline; checkpoints and stops at their ends (stash.py)
        for first, count in supervisor.segments(start):
            def on_step(n: int, first: int = first) -> None:  # report each minibatch the (n+1)-th STEP completes
                per = engine.microbatches_per_step
                for k in range(first + n * per // m, first + (n + 1) * per // m):
                    report(k)

            engine.begin_segment(first, count)
            engine.run(engine.actions, on_step=on_step)
            supervisor.after_segment(first + count)
    supervisor.close()
    monitor.close()
    if engine.owns_loss and first_report is not None and first_report[0] < args.steps:
        steps, dt = args.steps - first_report[0], time.perf_counter() - first_report[1]
        rate = steps * m * args.microbatch_size / dt
        tok = f", {rate * spec.tokens_per_sample:.0f} tokens/s" if spec.tokens_per_sample else ""
        log.info("steady state (steps %d-%d): %.1f samples/s%s", first_report[0] + 1, args.steps, rate, tok)
    if world.device.type == "cuda":
        peaks = comm.gather(torch.cuda.max_memory_allocated(world.device), root=0)
        if world.rank == 0:
            log.info("peak GPU memory per rank (GiB): %s", [round(p / 2**30, 2) for p in peaks])
    save_error = save_model(engine, args.save, comm, args.checkpoint_dir) if args.save else None
    comm.Barrier()
    # NCCL may hang at interpreter exit when its process group is left for the destructor.
    shutdown()
    if save_error:
        from pipeflow.failure import AgreedError

        raise AgreedError(save_error)
    return 0


def save_model(engine: Any, path: str, comm: Any, checkpoint_dir: str | None = None) -> str | None:
    """One state_dict with nn.Sequential(*spec.layers)'s keys, gathered on rank 0 from each stage's replica 0.
    Collective; returns None, or on every rank the line saying that --save failed and where the weights went."""
    from pipeflow.outputs import write_model

    mine = (engine.stage.start, engine.state_dict()) if engine.r == 0 else None
    parts = comm.gather(mine, root=0)
    error = None
    if comm.Get_rank() == 0:
        full: dict[str, torch.Tensor] = {}
        for _, part in sorted((p for p in parts if p is not None), key=lambda p: p[0]):
            full.update(part)
        # A rank holding several chunks (interleaved) sends non-adjacent layers: order the keys by layer.
        full = dict(sorted(full.items(), key=lambda kv: int(kv[0].partition(".")[0])))
        error = write_model(full, path, checkpoint_dir)
    return comm.bcast(error, root=0)
