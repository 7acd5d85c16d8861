"""pipeflow-train's evaluation flags, --eval-every K and --eval-batches N: their help and their checks, each a
ValueError of one line (config.py makes it a ConfigError; pure: no torch). The runner evaluates after every
K-th step (runner.py); the asynchronous schedules only where their pipeline drains (stash.py, "Segments")."""
from __future__ import annotations

from typing import Any

from pipeflow.kinds import schedule_kind

# pipeflow-train --help's text for --eval-every (train.py, the one module that parses the command line)
EVERY_HELP = ("every K steps, evaluate (forward only, layers in eval mode) the first --eval-batches minibatches of the "
              "model's eval_dataset, in order: 'eval loss' line, TensorBoard loss/eval (default 0: never); async/2bw "
              "only at segment ends (a multiple of --checkpoint-every)")


def check(args: Any, schedule: str | None, what: str = "--schedule") -> None:
    """The flags of `args` (a TrainConfig) under `schedule` (None: not known yet). The asynchronous schedules evaluate
    at segment ends: the multiples of --checkpoint-every with --checkpoint-dir, and the run's end; every multiple of K
    up to --steps must be one (an evaluation mid-segment would need a drain there, changing what the run trains)."""
    every, steps = args.eval_every, args.steps
    if every < 0:
        raise ValueError(f"--eval-every must be >= 0 steps (0: never evaluate), found {every}")
    if args.eval_batches < 1:
        raise ValueError(f"--eval-batches must be >= 1 minibatches, found {args.eval_batches}")
    if not every or schedule is None or schedule_kind(schedule).flush:
        return
    cut = args.checkpoint_every if args.checkpoint_dir else 0
    off = next((k for k in range(every, steps + 1, every) if k != steps and not (cut and k % cut == 0)), None)
    if off is None:
        return
    where = (f"the ends of its --checkpoint-every {cut} segments and of the run (step {steps})" if cut
             else f"only the run's end (step {steps}) without --checkpoint-dir DIR --checkpoint-every C")
    fix = f"a multiple of {cut}" if cut else f"{steps}, or --checkpoint-every C with {every} a multiple of C"
    raise ValueError(f"--eval-every {every} under {what} {schedule} evaluates where the pipeline drains, at {where}, "
                     f"and step {off} is not one; expected --eval-every {fix}, found {every}")


def check_dataset(args: Any, spec: Any) -> None:
    """--eval-every reads the model's ModelSpec.eval_dataset: refused at set-up, before any planning, where the
    builder gave none."""
    if not args.eval_every:
        return
    if spec.eval_dataset is None:
        raise ValueError(f"--eval-every {args.eval_every} evaluates ModelSpec.eval_dataset, which model "
                         f"{args.model!r} does not have (None); give its builder's ModelSpec an eval_dataset or drop "
                         "--eval-every")
    if len(spec.eval_dataset) == 0:
        raise ValueError(f"--eval-every {args.eval_every}: model {args.model!r} has an empty eval_dataset")
