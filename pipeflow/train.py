"""`pipeflow-train`: pipeline-parallel training under MPI.

    mpirun -np 4 pipeflow-train --model gpt --schedule 1f1b --steps 50
    mpirun -np 4 pipeflow-train --model gpt --plan plan.json --steps 50 --tensorboard runs/gpt
    mpirun -np 2 pipeflow-train --model mlp --schedule gpipe --steps 3 --dtype float64 --save mlp.pt
    pipeflow-train --model gpt --steps 20        # one process: a single stage

With no --plan the layers are profiled and planned on the spot for the -np given.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from typing import Any

import torch

from partitioner.plan import Plan, PlanError
from pipeflow.schedule import SCHEDULES, ScheduleError
from pipeflow.spec import ModelError, ModelSpec, build_model, parse_model_args

log = logging.getLogger("pipeflow")

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class UsageError(ValueError):
    """A flag, file or world size that cannot work; reported on every rank, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeflow-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt", help="gpt, mlp or package.module:function (default gpt)")
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
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for a peer before failing")
    p.add_argument("--save", default=None, help="write the trained model's state_dict here (rank 0)")
    p.add_argument("--log-every", type=int, default=0, help="steps between loss reports (default: steps/10)")
    p.add_argument("--layers-per-stage", default=None,
                   help="with no --plan: comma-separated layer counts per stage instead of planning, e.g. 7,6,6,5")
    return p


def check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "microbatch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, found {getattr(args, name)}")
    if args.microbatches is not None and args.microbatches < 1:
        raise UsageError(f"--microbatches must be >= 1, found {args.microbatches}")
    if args.schedule is not None and args.schedule not in SCHEDULES:
        raise UsageError(f"unknown schedule {args.schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0 seconds, found {args.timeout}")


def make_plan(args: argparse.Namespace, spec: ModelSpec, world_size: int, rank: int, mpi: Any) -> Plan:
    """The plan from --plan, or an even / explicit split over world_size single-replica stages."""
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

    counts = None
    if args.layers_per_stage:
        try:
            counts = [int(x) for x in args.layers_per_stage.split(",")]
        except ValueError:
            raise UsageError(f"--layers-per-stage must be comma-separated integers, found {args.layers_per_stage!r}")
        if len(counts) != world_size:
            raise UsageError(f"--layers-per-stage gives {len(counts)} stages but -np is {world_size}")
    return even_plan(n, world_size, schedule=args.schedule or "1f1b", microbatches=args.microbatches or 8,
                     layer_counts=counts)


def make_optimizer(args: argparse.Namespace) -> Any:
    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if args.optimizer == "sgd":
            return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
        cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.AdamW
        return cls(params, lr=args.lr, weight_decay=args.weight_decay)
    return factory


class Progress:
    """One line per report on the rank that owns the loss: a live bar on a terminal, log lines otherwise."""

    def __init__(self, total: int, samples_per_step: int, tokens_per_sample: int) -> None:
        self.total, self.sps, self.tps = total, samples_per_step, tokens_per_sample
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last_t, self.last_step = self.t0, 0

    def report(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        rate = (step - self.last_step) * self.sps / max(now - self.last_t, 1e-9)
        self.last_t, self.last_step = now, step
        tok = f" {rate * self.tps / 1000:.1f}k tok/s" if self.tps else ""
        if self.tty:
            width = 30
            done = int(width * step / self.total)
            sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{self.total} "
                             f"loss {loss:.4f} {rate:.1f} samples/s{tok}")
            if step == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            log.info("step %d/%d loss %.4f %.1f samples/s%s", step, self.total, loss, rate, tok)


def setup_logging(rank: int, size: int) -> None:
    prefix = f"[rank {rank}] " if size > 1 else ""
    logging.basicConfig(level=os.environ.get("PIPEFLOW_LOG", "INFO"), stream=sys.stderr,
                        format=f"{prefix}%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    setup_logging(rank, size)
    # Set-up errors are the same on every rank (same flags, files, model): each rank reports and exits;
    # an error on some ranks only is shared through one MPI agreement so that none waits for the others.
    error: str | None = None
    try:
        check_args(args)
        spec = build_model(args.model, parse_model_args(args.model_args), seed=args.seed)
        plan = make_plan(args, spec, size, rank, comm)
    except (UsageError, PlanError, ModelError, ScheduleError, ValueError) as e:
        error = str(e)
    errors = comm.allgather(error)
    if any(errors):
        first = next(r for r, e in enumerate(errors) if e)
        msg = error or f"rank {first} failed to start: {errors[first]}"
        print(f"pipeflow-train: error: [rank {rank}] {msg}", file=sys.stderr, flush=True)
        return 2
    try:
        return run(args, spec, plan, comm)
    except (UsageError, PlanError, ScheduleError) as e:
        print(f"pipeflow-train: error: [rank {rank}] {e}", file=sys.stderr, flush=True)
        comm.Abort(2)
        return 2
    except Exception:
        traceback.print_exc()
        print(f"pipeflow-train: rank {rank} failed (traceback above); stopping all ranks", file=sys.stderr,
              flush=True)
        comm.Abort(1)
        return 1


def run(args: argparse.Namespace, spec: ModelSpec, plan: Plan, comm: Any) -> int:
    from pipeflow.comm import init_world
    from pipeflow.data.loader import MicrobatchLoader
    from pipeflow.engine import Engine

    world = init_world(device=args.device, timeout_s=args.timeout)
    if world.rank == 0:
        log.info("plan: %s, %d microbatches of %d, stages %s", plan.schedule, plan.microbatches,
                 args.microbatch_size, [(list(st.layers), st.ranks) for st in plan.stages])
    loader = MicrobatchLoader(spec.dataset, args.microbatch_size, seed=args.seed, shuffle=not args.no_shuffle)
    engine = Engine(world, plan, spec, schedule=plan.schedule, optimizer_factory=make_optimizer(args),
                    loader=loader, dtype=DTYPES[args.dtype], total_steps=args.steps)
    m = plan.microbatches
    every = args.log_every or max(1, args.steps // 10)
    progress = Progress(args.steps, m * args.microbatch_size, spec.tokens_per_sample) if engine.owns_loss else None
    last_reported = 0

    def report(k: int) -> None:
        nonlocal last_reported
        step = k + 1
        if step % every == 0 or step == args.steps:
            loss = engine.take_loss((step - last_reported) * m)
            last_reported = step
            if progress is not None and loss is not None:
                progress.report(step, loss)

    if engine.flush:
        for k in range(args.steps):
            engine.train_step(k)
            report(k)
    else:
        engine.run(engine.actions, on_step=lambda n: report(n // m) if (n + 1) % m == 0 else None)
    if args.save:
        save_model(engine, args.save, comm)
    comm.Barrier()
    return 0


def save_model(engine: Any, path: str, comm: Any) -> None:
    """One state_dict with nn.Sequential(*spec.layers)'s keys, gathered on rank 0 from each stage's replica 0."""
    mine = (engine.stage.start, engine.state_dict()) if engine.r == 0 else None
    parts = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        full: dict[str, torch.Tensor] = {}
        for _, part in sorted((p for p in parts if p is not None), key=lambda p: p[0]):
            full.update(part)
        torch.save(full, path)
        log.info("saved %d tensors to %s", len(full), path)


if __name__ == "__main__":
    sys.exit(main())
