"""pipeflow-train's set-up on every rank: the ranks' arguments compared, then the flags, outputs, model and plan
checked, their errors shared through one MPI agreement, so that bad input is one line and exit 2 before anything
expensive runs (docs/failures.md, Set-up errors)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partitioner.plan import Plan, PlanError
from pipeflow import config, evalflags
from pipeflow.failure import UsageError, say
from pipeflow.outputs import prepare_outputs
from pipeflow.planning import check_model_on_plan, make_plan
from pipeflow.schedule import SCHEDULES, ScheduleError
from pipeflow.spec import ModelError, ModelSpec, build_model, parse_model_args

if TYPE_CHECKING:
    from pipeflow.control import Control


@dataclass
class Ready:
    """What set-up leaves a run: the validated flags (under --global-batch with the microbatch size the planner
    chose), the model, its plan, and the size of the plan's action lists in microbatches."""

    cfg: config.TrainConfig
    spec: ModelSpec
    plan: Plan
    list_size: int


def _shown(value: Any) -> str:
    return "not given" if value is None or value is False else "given" if value is True else \
        repr(value) if value == "" else str(value)


def different_arguments(flags: list[dict[str, Any]]) -> str | None:
    """The line for ranks started with different arguments (each rank's parsed flags in rank order, argparse's
    names in the parser's order), naming the first flag that differs and its values; None when all agree.
    mpirun's MPMD form (`-np 1 A : -np 1 B`) starts ranks with other flags: a rank training fewer steps than its
    peer would leave it waiting forever, another microbatch size fails deep in torch."""
    for name, mine in flags[0].items():
        for rank, theirs in enumerate(flags[1:], 1):
            if repr(theirs.get(name)) != repr(mine):  # repr: a nan equals itself
                return (f"the ranks were started with different arguments: --{name.replace('_', '-')} is "
                        f"{_shown(mine)} on rank 0 and {_shown(theirs.get(name))} on rank {rank}; start every rank "
                        "with the same pipeflow-train arguments")
    return None


def report_setup_errors(errors: list[str | None], rank: int) -> None:
    """One line per distinct error: rank 0 says an error every rank found; otherwise each rank with an
    error says its own, prefixed with its rank (so that lines from different ranks never merge)."""
    if all(e == errors[0] for e in errors):
        if rank == 0:
            say(f"pipeflow-train: error: {errors[0]}")
    elif errors[rank]:
        say(f"pipeflow-train: error: [rank {rank}] {errors[rank]}")


def set_up(flags: dict[str, Any], comm: Control) -> Ready | None:
    """Collective, on the parsed flags (argparse's names and values): every check of the run, in order, on every
    rank; None, once the error's line is written, where any rank found one (every rank then exits 2). The flags are
    compared first, in an agreement of their own: ranks that disagree on them would not even agree on which
    collectives follow (planning on the spot's)."""
    rank, size = comm.rank, comm.size
    error = different_arguments(comm.allgather(flags))
    if error:
        report_setup_errors([error] * size, rank)
        return None
    # Set-up errors are mostly the same on every rank (same flags, files, model): one MPI agreement
    # shares them, so that none waits for the others, and rank 0 reports an error they all found.
    try:
        cfg = config.TrainConfig.from_flags(flags, os.environ)  # from here on the runtime reads this, not the flags
        prepare_outputs(cfg, rank)  # every output path writable; rank 0 locks --checkpoint-dir until it exits
        spec = build_model(cfg.model, parse_model_args(cfg.model_args), seed=cfg.seed)
        evalflags.check_dataset(cfg, spec)
        plan = make_plan(cfg, spec, size, rank, comm)
        if cfg.global_batch is not None:  # every rank loads microbatches of the size the planner chose
            cfg = dataclasses.replace(cfg, microbatch_size=int(plan.extra["planner"]["microbatch_size"]))
        list_size = config.check_plan(plan, cfg, SCHEDULES)
        check_model_on_plan(spec, plan, cfg.device)
    except (UsageError, PlanError, ModelError, ScheduleError, ValueError) as e:
        error = str(e)
    errors = comm.allgather(error)
    if any(errors):
        report_setup_errors(errors, rank)
        return None
    return Ready(cfg, spec, plan, list_size)
