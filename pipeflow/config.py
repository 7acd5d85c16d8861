"""Validation of pipeflow-train's flags and environment before any process group, model copy or schedule
is built: each check raises ConfigError with one line saying what was expected and what was found."""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from pipeflow.kinds import schedule_kind

# Microbatches in one action list: a flush schedule's m, an asynchronous one's m x steps of a segment.
# Every rank builds, validates and dry-runs the lists of all workers in Python (schedule.generate):
# about 3 KB and 30-150 us per microbatch, so 10^6 is ~3 GB and a minute or two per rank, and the
# 10^8 a typo gives would need ~300 GB and hours (issue 11: "--microbatches 100000000 hangs at start").
MAX_SCHEDULE_MICROBATCHES = 1_000_000
SLOW_SCHEDULE_MICROBATCHES = 20_000  # above this, say that building the schedule takes a while
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    """A flag or environment variable that cannot work; reported in one line, exit code 2."""


def log_level(text: str | None) -> int:
    """PIPEFLOW_LOG as a logging level: a name (any case) or a number; unset: INFO."""
    if text is None or not text.strip():
        return logging.INFO
    name = text.strip().upper()
    if name in LOG_LEVELS:
        return int(getattr(logging, name))
    if name.isdigit():
        return int(name)
    raise ConfigError(f"PIPEFLOW_LOG must be one of {', '.join(LOG_LEVELS)} (or a number), found {text!r}")


def _finite_nonnegative(flag: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{flag} must be a finite number >= 0, found {value}")


def check_optimizer(args: Any) -> None:
    """torch.optim's own checks fail later, on every rank, with a traceback (and let inf through)."""
    _finite_nonnegative("--lr", args.lr)
    _finite_nonnegative("--momentum", args.momentum)
    _finite_nonnegative("--weight-decay", args.weight_decay)


def check_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda needs a GPU, but torch.cuda.is_available() is False on this host "
                              f"(torch {torch.__version__}); use --device cpu or auto")


def check_environment(environ: Mapping[str, str]) -> None:
    """The PIPEFLOW_* knobs of the README: checked on every run, not only where they are used."""
    from pipeflow.comm import p2p_max_ctas

    log_level(environ.get("PIPEFLOW_LOG"))
    try:
        p2p_max_ctas(environ)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    text = environ.get("PIPEFLOW_STACK_DUMP_S")
    if text and stack_dump_seconds(environ) is None:
        raise ConfigError(f"PIPEFLOW_STACK_DUMP_S must be a number of seconds > 0, found {text!r}")


def stack_dump_seconds(environ: Mapping[str, str]) -> float | None:
    """PIPEFLOW_STACK_DUMP_S as seconds, or None when unset or invalid (check_environment reports it)."""
    try:
        seconds = float(environ.get("PIPEFLOW_STACK_DUMP_S") or "nan")
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def check_args(args: Any, environ: Mapping[str, str]) -> None:
    """Every check that needs neither the model nor the plan."""
    check_optimizer(args)
    if not math.isfinite(args.timeout):
        raise ConfigError(f"--timeout must be a finite number of seconds > 0, found {args.timeout}")
    if args.max_skips < 0:
        raise ConfigError(f"--max-skips must be >= 0 (0: never stop), found {args.max_skips}")
    if args.microbatches is not None:
        check_schedule_size(args.microbatches, "--microbatches")
    check_device(args.device)
    check_environment(environ)


def check_schedule_size(microbatches: int, what: str, hint: str = "") -> None:
    if microbatches > MAX_SCHEDULE_MICROBATCHES:
        raise ConfigError(
            f"{what} gives {microbatches} microbatches in one schedule, more than the {MAX_SCHEDULE_MICROBATCHES} "
            f"pipeflow can build (every rank holds every worker's action list, ~3 KB per microbatch){hint}; "
            "use fewer, larger microbatches (--microbatch-size)")


def check_plan(plan: Any, args: Any, schedules: tuple[str, ...]) -> int:
    """The plan's schedule and the size of the action list it gives; returns that size in microbatches."""
    if plan.schedule not in schedules:
        raise ConfigError(f"the plan's schedule {plan.schedule!r} is unknown: expected one of {', '.join(schedules)}"
                          " (edit the plan or pass --schedule)")
    if schedule_kind(plan.schedule).flush:
        check_schedule_size(plan.microbatches, "the plan's microbatches" if args.microbatches is None
                            else "--microbatches")
        return int(plan.microbatches)
    # Asynchronous schedules run a segment's minibatches as one list (engine.begin_segment).
    segment = min(args.checkpoint_every, args.steps) if args.checkpoint_dir and args.checkpoint_every else args.steps
    total = plan.microbatches * segment
    check_schedule_size(total, f"--schedule {plan.schedule} with {plan.microbatches} microbatches x {segment} "
                        "steps per segment", hint="; --checkpoint-dir DIR --checkpoint-every K runs it in "
                        "segments of K steps")
    return int(total)
