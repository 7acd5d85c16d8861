"""pipeflow-train's configuration: TrainConfig, the one thing the runtime gets from the command line (issue 12),
validated before any process group, model copy or schedule is built; each check raises ConfigError with one
line saying what was expected and what was found."""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pipeflow.kinds import schedule_kind
from pipeflow.lrsched import LrSchedule, check

LR_FLAGS = {"warmup": "--lr-warmup", "decay": "--lr-decay", "min_lr": "--min-lr", "decay_steps": "--lr-decay-steps",
            "lr": "--lr", "steps": "--steps"}

# Microbatches in one action list: a flush schedule's m, an asynchronous one's m x steps of a segment.
# Every rank builds, validates and dry-runs the lists of all workers in Python (schedule.generate):
# about 3 KB and 30-150 us per microbatch, so 10^6 is ~3 GB and a minute or two per rank, and the
# 10^8 a typo gives would need ~300 GB and hours (issue 11: "--microbatches 100000000 hangs at start").
MAX_SCHEDULE_MICROBATCHES = 1_000_000
SLOW_SCHEDULE_MICROBATCHES = 20_000  # above this, say that building the schedule takes a while
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MICROBATCH_SIZE = 4  # --microbatch-size's default; 0 in a TrainConfig under --global-batch: the planner chooses
SEEDS = (-2**63, 2**64 - 1)  # what torch.manual_seed takes


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


def check_clip_grad_norm(value: float | None, schedule: str | None, *, flag: str = "--clip-grad-norm",
                         what: str = "--schedule") -> None:
    """Clipping by the global gradient norm (clip.py): MAX a finite number > 0, and a schedule with one update per
    minibatch on every stage. async's stages update after each of their microbatches, each at its own time: a norm
    over the stages per update would make every stage wait for the others, stalling the pipeline."""
    if value is None:
        return
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} must be a finite number > 0 (the most the gradients' global L2 norm may be), "
                          f"found {value}")
    if schedule is not None and schedule_kind(schedule).step_per_backward:
        use = "--schedule 2bw" if flag.startswith("--") else "schedule='2bw'"
        raise ConfigError(f"{flag} needs one gradient norm over all stages per update, which {what} {schedule} does "
                          "not have: each stage updates after each of its microbatches, at its own time, and a norm "
                          f"over the stages would stall the pipeline; use {use} (asynchronous, one update per "
                          "minibatch) or a flush schedule such as 1f1b")


def check_lr_schedule(args: Any) -> None:
    """--lr-warmup, --lr-decay, --min-lr and --lr-decay-steps (lrsched.py), against --lr and --steps."""
    try:
        check(warmup=args.lr_warmup, decay=args.lr_decay, min_lr=args.min_lr, decay_steps=args.lr_decay_steps,
              lr=args.lr, steps=args.steps, names=LR_FLAGS)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_eval(args: Any, schedule: str | None, what: str = "--schedule") -> None:
    """--eval-every and --eval-batches (evalflags.py)."""
    from pipeflow import evalflags

    try:
        evalflags.check(args, schedule, what)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda needs a GPU, but torch.cuda.is_available() is False on this host "
                              f"(torch {torch.__version__}); use --device cpu or auto")


def check_environment(environ: Mapping[str, str]) -> None:
    """The PIPEFLOW_* knobs of the README: checked on every run, not only where they are used."""
    from pipeflow.cesetup import p2p_transport, reduce_transport
    from pipeflow.graphcheck import graphs_enabled
    from pipeflow.links import gloo_groups, inplace_elements, p2p_max_ctas, reduce_late
    from pipeflow.split import gemm_accumulation

    log_level(environ.get("PIPEFLOW_LOG"))
    try:
        p2p_max_ctas(environ)
        inplace_elements(environ)
        reduce_late(environ)
        gloo_groups(environ)
        p2p_transport(environ)
        reduce_transport(environ)
        gemm_accumulation(environ)
        graphs_enabled(environ)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    text = environ.get("PIPEFLOW_STACK_DUMP_S")
    if text and stack_dump_seconds(environ) is None:
        raise ConfigError(f"PIPEFLOW_STACK_DUMP_S must be a number of seconds > 0, found {text!r}")


def check_transport(device: str, environ: Mapping[str, str]) -> None:
    """PIPEFLOW_P2P=ce asks for the GPUs' copy engines: refused at once where the ranks run on CPUs."""
    import torch

    if environ.get("PIPEFLOW_P2P") == "ce" and (device == "cpu" or not torch.cuda.is_available()):
        raise ConfigError(f"PIPEFLOW_P2P=ce moves tensors on the GPUs' copy engines, but the ranks run on the CPU "
                          f"(--device {device}); use PIPEFLOW_P2P=auto or nccl")


def stack_dump_seconds(environ: Mapping[str, str]) -> float | None:
    """PIPEFLOW_STACK_DUMP_S as seconds, or None when unset or invalid (check_environment reports it)."""
    try:
        seconds = float(environ.get("PIPEFLOW_STACK_DUMP_S") or "nan")
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


@dataclass(frozen=True)
class TrainConfig:
    """pipeflow-train's flags (README, Commands; the defaults are the flags'), validated on creation:
    every check that needs neither the model nor the plan, one line each (ConfigError, exit 2)."""

    model: str = "gpt"
    model_args: str | None = None
    plan: str | None = None
    schedule: str | None = None
    steps: int = 50
    microbatches: int | None = None
    microbatch_size: int = MICROBATCH_SIZE
    seed: int = 0
    no_shuffle: bool = False
    optimizer: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0
    device: str = "auto"
    dtype: str | None = None
    timeout: float = 300.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    skip_nonfinite: bool = False
    max_skips: int = 10
    save: str | None = None
    log_every: int = 0
    eval_every: int = 0
    eval_batches: int = 1
    tensorboard: str | None = None
    trace: str | None = None
    vertical_sync: bool = False
    shard_optimizer: bool = False
    clip_grad_norm: float | None = None
    lr_warmup: int = 0
    lr_decay: str = "none"
    min_lr: float = 0.0
    lr_decay_steps: int | None = None
    layers_per_stage: str | None = None
    straight: bool = False
    topology: str | None = None
    memory_per_worker: str | None = None
    warmup: str = "plan"
    peak_tflops: float | None = None
    virtual_stages: int | None = None
    global_batch: int | None = None

    def __post_init__(self) -> None:
        from pipeflow.kinds import SCHEDULES

        check_optimizer(self)
        check_clip_grad_norm(self.clip_grad_norm, self.schedule if self.schedule in SCHEDULES else None)
        check_lr_schedule(self)
        if not math.isfinite(self.timeout):
            raise ConfigError(f"--timeout must be a finite number of seconds > 0, found {self.timeout}")
        if self.max_skips < 0:
            raise ConfigError(f"--max-skips must be >= 0 (0: never stop), found {self.max_skips}")
        check_eval(self, self.schedule if self.schedule in SCHEDULES else None)
        if self.microbatches is not None:
            check_schedule_size(self.microbatches, "--microbatches")
        check_device(self.device)
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, found {self.steps}")
        if self.microbatch_size < (0 if self.global_batch is not None else 1):
            check_microbatch_size(self.microbatch_size)
        if self.log_every < 0:
            raise ConfigError(f"--log-every must be >= 1 steps (or 0: --steps / 10), found {self.log_every}")
        if not SEEDS[0] <= self.seed <= SEEDS[1]:
            raise ConfigError(f"--seed must be an integer from -2**63 to 2**64 - 1 (what torch.manual_seed takes), "
                              f"found {self.seed}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(f"--microbatches must be >= 1, found {self.microbatches}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if self.vertical_sync and self.schedule and not schedule_kind(self.schedule).vertical_sync:
            raise ConfigError(f"--vertical-sync needs --schedule async, found {self.schedule}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"--peak-tflops must be > 0 TFLOP/s, found {self.peak_tflops}")
        if self.timeout <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds, found {self.timeout}")
        if self.warmup not in ("plan", "min", "fill") and not all(x.strip().isdigit() for x in self.warmup.split(",")):
            raise ConfigError(f"--warmup must be plan, min, fill or comma-separated counts like 9,6,3,0, found "
                              f"{self.warmup!r}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be >= 0 steps, found {self.checkpoint_every}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir (where to write the checkpoints)")

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], environ: Mapping[str, str]) -> TrainConfig:
        """The config of parsed flags (argparse's dests, vars(namespace): one field each; --microbatch-size not
        given: the default, or 0 under --global-batch), after which the PIPEFLOW_* knobs of `environ` are checked."""
        b = flags.get("microbatch_size")
        if b is not None:
            check_microbatch_size(b)
        config = cls(**{**flags, "microbatch_size": b if b is not None else
                        MICROBATCH_SIZE if flags.get("global_batch") is None else 0})
        check_environment(environ)
        check_transport(config.device, environ)
        return config

    def as_dict(self) -> dict[str, Any]:
        """The flags as a dict (TensorBoard's config text)."""
        return asdict(self)

    @property
    def lr_schedule(self) -> LrSchedule | None:
        """The learning-rate schedule of the flags (lrsched.py); None where the lr stays --lr throughout."""
        if not self.lr_warmup and self.lr_decay == "none":
            return None
        end = self.lr_decay_steps if self.lr_decay_steps is not None else self.steps  # kept by a longer run's resume
        return LrSchedule(warmup=self.lr_warmup, decay=self.lr_decay, min_lr=self.min_lr,
                          decay_steps=end if self.lr_decay != "none" else None)

    @property
    def segment_steps(self) -> int | None:
        """Asynchronous schedules: minibatches per segment (checkpoints cut them); None: the whole run."""
        return (min(self.checkpoint_every, self.steps) or None) if self.checkpoint_dir else None


def check_microbatch_size(b: int) -> None:
    if b < 1:
        raise ConfigError(f"--microbatch-size must be >= 1, found {b}")


def check_schedule_size(microbatches: int, what: str, hint: str = "") -> None:
    if microbatches > MAX_SCHEDULE_MICROBATCHES:
        raise ConfigError(
            f"{what} gives {microbatches} microbatches in one schedule, more than the {MAX_SCHEDULE_MICROBATCHES} "
            f"pipeflow can build (every rank holds every worker's action list, ~3 KB per microbatch){hint}; "
            "use fewer, larger microbatches (--microbatch-size)")


def check_plan(plan: Any, args: TrainConfig, schedules: tuple[str, ...]) -> int:
    """The plan's schedule and the size of the action list it gives; returns that size in microbatches."""
    if plan.schedule not in schedules:
        raise ConfigError(f"the plan's schedule {plan.schedule!r} is unknown: expected one of {', '.join(schedules)}"
                          " (edit the plan or pass --schedule)")
    check_clip_grad_norm(args.clip_grad_norm, plan.schedule, what="the plan's schedule")
    check_eval(args, plan.schedule, what="the plan's schedule")
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
