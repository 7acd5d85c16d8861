"""The training loop of one run: world, monitor, engine and supervisor made, steps run, the model saved."""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from partitioner.plan import Plan
from pipeflow.config import TrainConfig
from pipeflow.failure import StopTraining
from pipeflow.mfu import mfu, peak_tflops
from pipeflow.planning import resolve_warmup
from pipeflow.spec import ModelSpec, model_dtype

if TYPE_CHECKING:
    from pipeflow.api import OptimizerFactory, Pipeline
    from pipeflow.control import Control
    from pipeflow.watchdog import Watchdog

log = logging.getLogger("pipeflow")

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def sparse_gradients(layers: list[torch.nn.Module]) -> bool:
    """Whether a layer makes sparse gradients (nn.Embedding or nn.EmbeddingBag with sparse=True), which torch's
    fused optimizers refuse ("`_fused_sgd` does not support sparse gradients")."""
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return any(isinstance(m, kinds) and m.sparse for layer in layers for m in layer.modules())


def fused_step(params: list[Any], *, sparse: bool) -> bool:
    """One kernel per step: on GPUs, unless a layer makes sparse gradients."""
    return bool(params) and all(p.is_cuda for p in params) and not sparse


def make_optimizer(args: TrainConfig, *, sparse: bool = False) -> OptimizerFactory:
    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        fused = fused_step(params, sparse=sparse)
        if args.optimizer == "sgd":
            # Fused SGD skips a non-finite step on the device (guard.py) exactly only without momentum: a
            # skipped first step would leave its momentum buffers uninitialised (torch's _fused_sgd).
            return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                                   fused=(fused and args.momentum == 0) or None)
        cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.AdamW
        return cls(params, lr=args.lr, weight_decay=args.weight_decay, fused=fused or None)
    return factory


def run(args: TrainConfig, spec: ModelSpec, plan: Plan, comm: Control, watchdog: Watchdog | None = None) -> int:
    from pipeflow.api import Pipeline
    from pipeflow.checkpoint import run_info
    from pipeflow.comm import init_world, shutdown
    from pipeflow.data.loader import MicrobatchLoader
    from pipeflow.monitor import Monitor
    from pipeflow.signals import SignalStop
    from pipeflow.supervisor import Supervisor, step_guard

    world = init_world(device=args.device, timeout_s=args.timeout)
    # mpirun (MPICH's) reports a killed process by its pid and ends the job before any rank can speak:
    # this line is what maps that pid back to a rank.
    pids = comm.gather((os.uname().nodename, os.getpid()))
    if pids is not None:
        log.info("processes by rank: %s", ", ".join(f"{r}={h}:{p}" for r, (h, p) in enumerate(pids)))
        log.info("plan: %s, %d microbatches of %d, stages %s", plan.schedule, plan.microbatches,
                 args.microbatch_size, [(list(st.layers), st.ranks) for st in plan.stages])
    loader = MicrobatchLoader(spec.dataset, args.microbatch_size, seed=args.seed, shuffle=not args.no_shuffle)
    m = plan.microbatches
    loader.stage_on(world.device, m)  # each minibatch's samples go to the device in one copy (issue 15)
    held_out = None  # --eval-every: eval_dataset in its own order, never shuffled (docs/reproducibility.md)
    if args.eval_every and spec.eval_dataset is not None:  # evalflags.check_dataset: it has one
        held_out = MicrobatchLoader(spec.eval_dataset, args.microbatch_size, shuffle=False)
        held_out.stage_on(world.device, m)
    dtype = DTYPES[args.dtype] if args.dtype else model_dtype(torch.nn.ModuleList(spec.layers))
    peak = peak_tflops(world.device, dtype, args.peak_tflops)
    monitor = Monitor(comm, plan, world.device, total_steps=args.steps, samples_per_step=m * args.microbatch_size,
                      tokens_per_sample=spec.tokens_per_sample, tensorboard=args.tensorboard, trace=args.trace,
                      config=args.as_dict(), flops_per_sample=spec.flops_per_sample, peak_tflops=peak)
    signals = SignalStop()
    # The Python API's pipeline (api.py), fed by the dataset's loader, with the monitor's timer and the
    # non-finite guard (supervisor.step_guard) as its hooks.
    optimizer = make_optimizer(args, sparse=sparse_gradients(spec.layers))
    pipe = Pipeline(spec.layers, spec.loss_fn, plan=plan, optimizer=optimizer,
                    warmup=resolve_warmup(args.warmup, plan), dtype=DTYPES[args.dtype] if args.dtype else None,
                    seed=args.seed, vertical_sync=args.vertical_sync, world=world, data=loader, timer=monitor.timer,
                    step_gate=step_guard(args, comm, signals), total_steps=args.steps,
                    segment_steps=args.segment_steps, shard_optimizer=args.shard_optimizer,
                    clip_grad_norm=args.clip_grad_norm, lr_schedule=args.lr_schedule)
    engine = pipe.engine
    ce = engine.p2p.ce
    if ce is not None and watchdog is not None:  # transfers on the copy engines time out through the watchdog
        watchdog.watch(lambda: ce.stalled(args.timeout))
    if pids is not None and engine.warmup is not None:
        how = "the plan's" if args.warmup == "plan" else f"--warmup {args.warmup}"
        log.info("%s warm-up: %s forwards before the first backward per stage (%s)", plan.schedule,
                 ", ".join(map(str, engine.warmup)), how)
    if pids is not None and args.lr_schedule is not None:
        log.info("learning rate %g: %s (docs/schedules.md)", args.lr, args.lr_schedule.describe())
    info = run_info(args, spec, plan)
    # This rank keeps only its own stage's layers (engine.stage): drop the model-wide list so that the
    # other stages' layers are freed (issue 10, item 3).
    spec.layers = []
    # Resume, checkpoints, signals and non-finite checks at step boundaries (supervisor.py, checkpoint.py).
    supervisor = Supervisor(args, engine, comm, info, signals)
    start = supervisor.start()
    pipe.step_count = start
    every = args.log_every or max(1, args.steps // 10)
    last_reported = start
    first_report: tuple[int, float] | None = None  # (step, time) of the first report: steady state after it
    eval_seconds = 0.0  # spent evaluating after the first report: not training time

    def evaluate(step: int) -> None:
        """--eval-every: after every K-th step, the first --eval-batches minibatches of eval_dataset (the same ones
        each time); at a step boundary, or under async and 2bw a segment's end (evalflags.check)."""
        nonlocal eval_seconds
        if held_out is None or step % args.eval_every:
            return
        t0 = time.perf_counter()
        losses = [pipe.evaluate(data=held_out, first=n * m) for n in range(args.eval_batches)]
        owned = [x for x in losses if x is not None]
        seconds = time.perf_counter() - t0
        eval_seconds += seconds if first_report is not None else 0.0
        monitor.evaluated(step, sum(owned) / len(owned) if owned else None, seconds)

    def report(k: int) -> None:
        nonlocal last_reported, first_report
        step = k + 1
        monitor.end_step(k)
        if step % every == 0 or step == args.steps:
            loss = pipe.take_loss(step - last_reported)
            last_reported = step
            if first_report is None:
                first_report = (step, time.perf_counter())
            monitor.report(step, loss, lr=pipe.lr(k), grad_norm=pipe.grad_norm() if engine.owns_loss else None,
                           show_lr=args.lr_schedule is not None)  # step k's update's lr, applied or due
        supervisor.after_step(step)

    monitor.start(start)
    try:
        if engine.flush:
            for k in range(start, args.steps):
                pipe.step(loss=False)  # the loss is read at reports only: no device sync per step
                report(k)
                evaluate(k + 1)
        else:  # segments that fill and drain the pipeline; checkpoints and stops at their ends (stash.py)
            for first, count in supervisor.segments(start):
                def on_step(n: int, first: int = first) -> None:  # report each minibatch the (n+1)-th STEP completes
                    per = engine.microbatches_per_step
                    for k in range(first + n * per // m, first + (n + 1) * per // m):
                        report(k)

                pipe.run_segment(first, count, on_step)
                supervisor.after_segment(first + count)
                evaluate(first + count)
    except StopTraining:  # every rank at one step boundary (a signal, an agreed non-finite stop): --trace written,
        monitor.close()   # its steps kept for a resumed run to append to (trace.append_trace)
        raise
    supervisor.close()
    monitor.close()
    if engine.owns_loss and first_report is not None and first_report[0] < args.steps:
        steps, dt = args.steps - first_report[0], time.perf_counter() - first_report[1] - eval_seconds
        rate = steps * m * args.microbatch_size / dt
        tok = f", {rate * spec.tokens_per_sample:.0f} tokens/s" if spec.tokens_per_sample else ""
        utilisation = mfu(rate, spec.flops_per_sample, world.size, peak)
        if utilisation is not None:
            tok += f", MFU {100 * utilisation:.1f}% per GPU ({peak:g} TFLOP/s peak)"
        log.info("steady state (steps %d-%d): %.1f samples/s%s", first_report[0] + 1, args.steps, rate, tok)
    if world.device.type == "cuda":
        # with the copy-engine rings (celink), which torch's allocator does not see
        peaks = comm.gather(torch.cuda.max_memory_allocated(world.device) + engine.p2p.ring_bytes())
        if peaks is not None:
            log.info("peak GPU memory per rank (GiB): %s", [round(p / 2**30, 2) for p in peaks])
    save_error = save_model(pipe, args.save, comm, args.checkpoint_dir) if args.save else None
    comm.barrier()
    engine.update.close()  # no transfer left in flight, no hook left on the layers (shard.py)
    engine.p2p.close()
    # NCCL may hang at interpreter exit when its process group is left for the destructor.
    shutdown()
    if save_error:
        from pipeflow.failure import AgreedError

        raise AgreedError(save_error)
    return 0


def save_model(pipe: Pipeline, path: str, comm: Control, checkpoint_dir: str | None = None) -> str | None:
    """One state_dict with nn.Sequential(*spec.layers)'s keys, gathered on rank 0 (Pipeline.state_dict).
    Collective; returns None, or on every rank the line saying that --save failed and where the weights went."""
    from pipeflow.outputs import write_model

    full = pipe.state_dict()
    error = write_model(full, path, checkpoint_dir) if full is not None else None
    return comm.bcast(error)
