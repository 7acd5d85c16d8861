"""`pipeflow-train`: pipeline-parallel training under MPI.

    mpirun -np 4 pipeflow-train --model gpt --schedule 1f1b --steps 50
    mpirun -np 4 pipeflow-train --model gpt --plan plan.json --steps 50 --tensorboard runs/gpt
    mpirun -np 2 pipeflow-train --model mlp --schedule gpipe --steps 3 --dtype float64 --save mlp.pt
    pipeflow-train --model gpt --steps 20        # one process: a single stage

With no --plan the layers are profiled and planned on the spot for the -np given.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import time
import traceback
from typing import Any, NoReturn

import torch

from partitioner.plan import Plan, PlanError
from pipeflow import config
from pipeflow.outputs import prepare_outputs, release_checkpoint_lock
from pipeflow.schedule import SCHEDULES, ScheduleError
from pipeflow.spec import ModelError, ModelSpec, build_model, parse_model_args

log = logging.getLogger("pipeflow")

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class UsageError(ValueError):
    """A flag, file or world size that cannot work; reported once (rank 0) when all ranks agree, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, written once: every rank parses the same argv before MPI starts, so only the process
        that the launcher calls rank 0 (or one not started by a launcher) says it."""
        rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMIX_RANK")
        if rank in (None, "0"):
            os.write(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n".encode())
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pipeflow-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt",
                   help="gpt, mlp or package.module:function (default gpt). The module is imported and the "
                        "function called with --model-args on every rank: like torch.load without weights_only, "
                        "this runs that code, so name only modules you trust")
    p.add_argument("--model-args", default=None, help="JSON object of builder keyword arguments")
    p.add_argument("--plan", default=None, help="plan.json from pipeflow-plan; default: plan on the spot")
    p.add_argument("--schedule", default=None, help=f"one of {', '.join(SCHEDULES)} (default: the plan's, or 1f1b)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (minibatches) to train")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per minibatch (default: plan's or 8)")
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-shuffle", action="store_true", help="samples in order instead of a seeded permutation")
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="cast the model to this dtype (default: keep the dtype its builder gave it)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for a peer before failing")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write checkpoints to DIR/step-NNNNNN/ (a file per stage, then a COMPLETE marker)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="steps between checkpoints (default 0: at the end, and when stopped by SIGTERM/SIGINT); "
                        "async/2bw drain their pipeline at each checkpoint (segments of K minibatches)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue from PATH (a step-NNNNNN directory or a checkpoint directory) or, without "
                        "PATH, from the newest complete checkpoint in --checkpoint-dir (none yet: from step 0)")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip steps whose loss or gradients are NaN/inf instead of stopping")
    p.add_argument("--max-skips", type=int, default=10, metavar="N",
                   help="with --skip-nonfinite: stop (exit 4) after N consecutive skipped steps (default 10; "
                        "0: never)")
    p.add_argument("--save", default=None, help="write the trained model's state_dict here (rank 0)")
    p.add_argument("--log-every", type=int, default=0, help="steps between loss reports (default: steps/10)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard scalars here (throughput, loss, per-stage times, bubble, memory)")
    p.add_argument("--trace", default=None, metavar="FILE.json",
                   help="write every rank's measured timeline as a Chrome trace (open in ui.perfetto.dev)")
    p.add_argument("--vertical-sync", action="store_true",
                   help="async: every stage uses the weight version stage 0 used (PipeDream §3.3)")
    p.add_argument("--layers-per-stage", default=None,
                   help="with no --plan: 'even', or comma-separated layer counts per stage (e.g. 8,6,6,6), instead "
                        "of profiling and planning on the spot")
    p.add_argument("--straight", action="store_true", help="planning on the spot: no replicated stages")
    p.add_argument("--topology", default=None, help="planning on the spot: e.g. 8x300GB/s,4x25GB/s")
    p.add_argument("--memory-per-worker", default=None, help="planning on the spot: e.g. 16GB")
    p.add_argument("--warmup", default="min",
                   help="1f1b forwards before the first backward, per stage: min (DAPPLE, S-1-s), fill (keep "
                        "early stages busy until their first gradient returns; more activation memory), or N,N,...")
    return p


def check_args(args: argparse.Namespace) -> None:
    config.check_args(args, os.environ)
    for name in ("steps", "microbatch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, found {getattr(args, name)}")
    if args.microbatches is not None and args.microbatches < 1:
        raise UsageError(f"--microbatches must be >= 1, found {args.microbatches}")
    if args.schedule is not None and args.schedule not in SCHEDULES:
        raise UsageError(f"unknown schedule {args.schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if getattr(args, "vertical_sync", False) and args.schedule not in (None, "async"):
        raise UsageError(f"--vertical-sync needs --schedule async, found {args.schedule}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0 seconds, found {args.timeout}")
    if args.warmup not in ("min", "fill") and not all(x.strip().isdigit() for x in args.warmup.split(",")):
        raise UsageError(f"--warmup must be min, fill or comma-separated counts like 9,6,3,0, found {args.warmup!r}")
    if args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0 steps, found {args.checkpoint_every}")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise UsageError("--checkpoint-every needs --checkpoint-dir (where to write the checkpoints)")


def make_plan(args: argparse.Namespace, spec: ModelSpec, world_size: int, rank: int, mpi: Any) -> Plan:
    """The plan from --plan; an even or explicit split (--layers-per-stage); otherwise rank 0 profiles
    the layers and runs the planner for this many workers, and every rank gets its plan."""
    n = len(spec.layers)
    if args.plan:
        plan = Plan.load(args.plan)
        plan.validate(num_layers=n, world_size=world_size)
        if args.microbatches is not None:
            plan.microbatches = args.microbatches
        if args.schedule is not None:
            plan.schedule = args.schedule
        return plan
    from partitioner.plan import even_plan

    if not args.layers_per_stage:
        return plan_on_the_spot(args, spec, world_size, rank, mpi)
    counts = None
    if args.layers_per_stage != "even":
        try:
            counts = [int(x) for x in args.layers_per_stage.split(",")]
        except ValueError:
            raise UsageError(f"--layers-per-stage must be comma-separated integers, found {args.layers_per_stage!r}"
                             ) from None
        if len(counts) != world_size:
            raise UsageError(f"--layers-per-stage gives {len(counts)} stages but -np is {world_size}")
    return even_plan(n, world_size, schedule=args.schedule or "1f1b", microbatches=args.microbatches or 8,
                     layer_counts=counts)


def plan_on_the_spot(args: argparse.Namespace, spec: ModelSpec, world_size: int, rank: int, mpi: Any) -> Plan:
    result: tuple[str, Any] = ("error", "rank 0 did not plan")
    if rank == 0:
        try:
            from partitioner.cli import plan_from_profile
            from partitioner.profiler import profile_model

            device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            t0 = time.perf_counter()
            profile = profile_model(spec, args.microbatch_size, device, dtype=args.dtype, warmup=1, repeats=3,
                                    seed=args.seed)
            plan = plan_from_profile(profile, world_size, schedule=args.schedule or "1f1b",
                                     microbatches=args.microbatches or 8, topology=args.topology,
                                     memory_per_worker=args.memory_per_worker, straight=args.straight,
                                     optimizer=args.optimizer)
            log.info("profiled %d layers on %s in %s and planned for %d workers in %.1f s (no --plan given); "
                     "predicted %s", len(spec.layers), device, profile.dtype, world_size, time.perf_counter() - t0,
                     {k: v for k, v in plan.predicted.items() if k != "peak_memory_bytes"})
            result = ("plan", plan.to_json())
        except (ValueError, RuntimeError) as e:
            result = ("error", f"planning on the spot failed: {e}")
    kind, value = mpi.bcast(result, root=0)
    if kind == "error":
        raise UsageError(value)
    return Plan.from_json(value, source="the plan made on the spot")


def resolve_warmup(text: str, plan: Plan) -> list[int] | None:
    """--warmup as per-stage counts, or None for the schedule's own (DAPPLE's minimum)."""
    from pipeflow.schedule import fill_warmup

    if text == "min":
        return None
    if plan.schedule != "1f1b":
        raise UsageError(f"--warmup {text} applies to --schedule 1f1b only, found {plan.schedule}")
    if text == "fill":
        return [fill_warmup(plan.replicas, s) for s in range(len(plan.stages))]
    counts = [int(x) for x in text.split(",")]
    if len(counts) != len(plan.stages):
        raise UsageError(f"--warmup gives {len(counts)} counts but the plan has {len(plan.stages)} stages")
    return counts


def check_ties(spec: ModelSpec, plan: Plan) -> None:
    """A Parameter shared by layers of several stages trains as one under gpipe and 1f1b (engine.py);
    the asynchronous schedules would give its copies different weight versions: refuse them here."""
    from pipeflow.engine import tied_async_error
    from pipeflow.reduce import find_ties
    from pipeflow.schedule import FLUSH_SCHEDULES

    if plan.schedule not in FLUSH_SCHEDULES:
        ties = find_ties(spec.layers, [st.layers for st in plan.stages], [st.ranks for st in plan.stages])
        if ties:
            raise UsageError(tied_async_error(ties, plan.schedule))


def make_optimizer(args: argparse.Namespace) -> Any:
    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if args.optimizer == "sgd":
            return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
        cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.AdamW
        fused = bool(params) and all(p.is_cuda for p in params)  # one kernel per step on GPUs
        return cls(params, lr=args.lr, weight_decay=args.weight_decay, fused=fused or None)
    return factory


def setup_logging(rank: int, size: int) -> None:
    """A handler once per process (basicConfig does nothing the second time); the level from
    $PIPEFLOW_LOG at every call, so that each run of main() in one process gets its own."""
    prefix = f"[rank {rank}] " if size > 1 else ""
    try:
        level = config.log_level(os.environ.get("PIPEFLOW_LOG"))
    except config.ConfigError:
        level = logging.INFO  # reported by check_args, once, with the other set-up errors
    logging.basicConfig(level=level, stream=sys.stderr, format=f"{prefix}%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)


class ProcessState:
    """Process-wide state a run changes, saved before and restored after it, so that main() can run
    many times in one process (tests/mpi_batch.py runs a test suite's cases in one MPI job) with no
    run seeing another's: the global RNGs (build_model seeds them), the default dtype, the SIGTERM /
    SIGINT handlers (an agreed stop returns before Supervisor.close restores them), the log level."""

    def __init__(self) -> None:
        import signal

        from pipeflow.failure import SignalStop

        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.dtype = torch.get_default_dtype()
        self.signals = {s: signal.getsignal(s) for s in SignalStop.SIGNALS}
        self.log_level = logging.getLogger().level

    def restore(self) -> None:
        import signal
        import threading

        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        torch.set_default_dtype(self.dtype)
        logging.getLogger().setLevel(self.log_level)
        if threading.current_thread() is threading.main_thread():
            for s, handler in self.signals.items():
                if handler is not None:
                    signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dump = config.stack_dump_seconds(os.environ)  # a bad value is reported with the other set-up errors
    if dump:  # debugging a hang: every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(dump, exit=True)
    from mpi4py import MPI

    from pipeflow.failure import Watchdog, write_pid_file

    comm = MPI.COMM_WORLD  # MPI is initialised once per process, by the import
    state = ProcessState()
    setup_logging(comm.Get_rank(), comm.Get_size())
    write_pid_file()
    # Peer heartbeats: a rank that dies or stops ends the job within --timeout, even where MPI would wait.
    watchdog = Watchdog(comm, args.timeout if args.timeout > 0 else 300.0).start()
    atexit.register(watchdog.stop)
    try:
        code = _main(args, comm, watchdog)
        watchdog.stop(sync=True)  # _main returns on all ranks together: none beats at a finalised peer
    except KeyboardInterrupt:  # SIGINT outside the training steps (which stop at a boundary): set-up, save
        if comm.Get_rank() == 0:
            from pipeflow.failure import say

            say("pipeflow-train: stopped by SIGINT outside the training steps; nothing saved")
        sys.stderr.flush()
        os._exit(130)  # 128 + SIGINT; threads may be inside gloo: leave without unwinding them
    finally:
        watchdog.stop()
        atexit.unregister(watchdog.stop)
        if torch.distributed.is_initialized():  # an agreed stop or error returns with the group still up
            torch.distributed.destroy_process_group()
        state.restore()
        release_checkpoint_lock()
    return code


def report_setup_errors(errors: list[str | None], rank: int) -> None:
    """One line per distinct error: rank 0 says an error every rank found; otherwise each rank with an
    error says its own, prefixed with its rank (so that lines from different ranks never merge)."""
    from pipeflow.failure import say

    if all(e == errors[0] for e in errors):
        if rank == 0:
            say(f"pipeflow-train: error: {errors[0]}")
    elif errors[rank]:
        say(f"pipeflow-train: error: [rank {rank}] {errors[rank]}")


def _main(args: argparse.Namespace, comm: Any, watchdog: Any) -> int:
    from pipeflow.failure import EXIT_FAILED, EXIT_NONFINITE, AgreedError, NonFiniteError, StopTraining, say

    rank, size = comm.Get_rank(), comm.Get_size()
    # Set-up errors are mostly the same on every rank (same flags, files, model): one MPI agreement
    # shares them, so that none waits for the others, and rank 0 reports an error they all found.
    error: str | None = None
    try:
        check_args(args)
        prepare_outputs(args, rank)  # every output path writable; rank 0 locks --checkpoint-dir until it exits
        spec = build_model(args.model, parse_model_args(args.model_args), seed=args.seed)
        plan = make_plan(args, spec, size, rank, comm)
        list_size = config.check_plan(plan, args, SCHEDULES)
        check_ties(spec, plan)
    except (UsageError, PlanError, ModelError, ScheduleError, ValueError) as e:
        error = str(e)
    errors = comm.allgather(error)
    if any(errors):
        report_setup_errors(errors, rank)
        return 2
    if rank == 0 and list_size > config.SLOW_SCHEDULE_MICROBATCHES:
        log.info("building the %s action lists of %d microbatches on every rank (up to minutes for 10^6)",
                 plan.schedule, list_size)
    try:
        return run(args, spec, plan, comm)
    except StopTraining as e:  # every rank stopped at the same step boundary
        if rank == 0:
            say(f"pipeflow-train: {e}")
        return e.code
    except AgreedError as e:
        if rank == 0:
            say(f"pipeflow-train: error: {e}")
        return 2
    except NonFiniteError as e:  # asynchronous schedules: no common boundary to stop at together
        say(f"pipeflow-train: error: [rank {rank}] {e}")
        comm.Abort(EXIT_NONFINITE)
        return EXIT_NONFINITE
    except (UsageError, PlanError, ScheduleError) as e:
        say(f"pipeflow-train: error: [rank {rank}] {e}")
        comm.Abort(2)
        return 2
    except Exception as e:
        silent = watchdog.suspects()  # a transfer failed: was it a dead or stopped peer?
        if silent:  # the peer's failure is the news; this rank's traceback would only bury it
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            say(f"pipeflow-train: error: [rank {rank}] rank {', '.join(map(str, silent))} stopped responding "
                f"(no heartbeat; here: {first}). Stopping all ranks.")
            comm.Abort(EXIT_FAILED)
            return EXIT_FAILED
        traceback.print_exc()
        say(f"pipeflow-train: rank {rank} failed (traceback above); stopping all ranks")
        comm.Abort(1)
        return 1


def run(args: argparse.Namespace, spec: ModelSpec, plan: Plan, comm: Any) -> int:
    from pipeflow.checkpoint import run_info
    from pipeflow.comm import init_world
    from pipeflow.data.loader import MicrobatchLoader
    from pipeflow.engine import Engine
    from pipeflow.failure import Supervisor
    from pipeflow.monitor import Monitor

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
    # Resume, checkpoints, signals and non-finite checks at step boundaries (failure.py, checkpoint.py).
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
    if torch.distributed.is_initialized():
        # NCCL may hang at interpreter exit when its process group is left for the destructor.
        torch.distributed.destroy_process_group()
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
        error = write_model(full, path, checkpoint_dir)
    return comm.bcast(error, root=0)


if __name__ == "__main__":
    sys.exit(main())
