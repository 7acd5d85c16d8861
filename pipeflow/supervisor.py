"""The step loop's glue: resume, checkpoints every K steps, stops at step boundaries (signals, non-finite)."""
from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import numpy as np

from pipeflow.config import TrainConfig
from pipeflow.control import Control
from pipeflow.failure import EXIT_NONFINITE, AgreedError, StopTraining
from pipeflow.guard import StepGuard
from pipeflow.hooks import GateFactory
from pipeflow.signals import SignalStop

log = logging.getLogger("pipeflow.failure")  # the name these lines had before failure.py was split: log lines unchanged


def step_guard(args: TrainConfig, comm: Control, signals: SignalStop) -> GateFactory:
    """The engine's step gate (its constructor's `step_gate`): a StepGuard of --skip-nonfinite/--max-skips
    that agrees on skips and on the stops `signals` records."""
    def make(engine: Any) -> StepGuard:
        return StepGuard(engine, comm, signals, skip_nonfinite=args.skip_nonfinite, agree_every_step=engine.flush,
                         max_skips=args.max_skips)
    return make


class Supervisor:
    """Glue between the step loop and the above: resume, checkpoints every K steps, stops at boundaries.
    `engine` was built with step_gate=step_guard(args, comm, signals): its StepGuard is the one it reads."""

    def __init__(self, args: TrainConfig, engine: Any, comm: Control, run_info: dict[str, Any],
                 signals: SignalStop) -> None:
        self.args, self.engine, self.run_info = args, engine, run_info
        self.comm = Control(comm)
        self.signals = signals
        if not isinstance(engine.step_gate, StepGuard):
            raise TypeError("Supervisor: build the engine with step_gate=step_guard(args, comm, signals)")
        self.guard: StepGuard = engine.step_gate
        self.saved_step = -1
        self.saved: Path | None = None
        self.done = 0  # steps finished on this rank
        self.immediate: Any = None  # interrupt.ImmediateStop

    def start(self) -> int:
        """Resume if asked (every rank agrees on the outcome); install the signal handlers.
        Returns the number of steps already done."""
        from pipeflow import checkpoint, restore
        from pipeflow.resume import choose

        step, error = 0, None
        if self.args.resume:
            path: Path | None = None
            try:  # the newest complete checkpoint whose files verify, the same on every rank
                path, marker = choose(self.comm, self.args.resume, self.args.checkpoint_dir)
                if path is not None:
                    step = restore.load(self.engine, path, self.run_info, marker)
                    assert marker is not None  # choose reads the marker of the checkpoint it picks
                    in_a_row, in_all = restore.skipped(self.engine, marker)
                    # Steps (async: updates) numbered and skips counted on from the checkpoint, as if never stopped
                    self.guard.resume(step, in_a_row=in_a_row, in_all=in_all)
            except checkpoint.CheckpointError as e:
                error = str(e)
            error = self.comm.agree(error)
            if error:
                raise AgreedError(error)
            if self.comm.rank == 0:
                if path is None:
                    log.warning("--resume: no complete checkpoint in %s yet; starting from step 0",
                                self.args.checkpoint_dir)
                else:
                    log.info("resumed from %s: continuing after step %d", path, step)
            if step >= self.args.steps:  # say so rather than do nothing silently
                raise StopTraining(f"nothing to train: the checkpoint {path} is at step {step} and --steps is "
                                   f"{self.args.steps}; pass --steps above {step} to train on"
                                   + (f" (--save {self.args.save} not written)" if self.args.save else ""), 0)
        self.saved_step = step
        # Asynchronous pipelines stop at segment boundaries (after_segment), which exist with --checkpoint-dir;
        # without one the run is one segment and signals end it as usual.
        if self.engine.flush or self.args.checkpoint_dir:
            self.signals.install()
        else:  # no boundary to stop at and nothing to save: a signal ends the job at once, in one line
            from pipeflow.interrupt import ImmediateStop

            self.immediate = ImmediateStop(self.comm, lambda: self.done).install()
        self.done = step
        return step

    def segments(self, start: int) -> list[tuple[int, int]]:
        """Asynchronous schedules: (first step, steps) of each segment from `start` on: boundaries at the
        multiples of --checkpoint-every (with --checkpoint-dir; stash.py, "Segments") and at the end."""
        total, every = self.args.steps, self.args.checkpoint_every if self.args.checkpoint_dir else 0
        if start >= total:
            return []
        cuts = [start, *(k for k in range(start + 1, total) if every and k % every == 0), total]
        return [(a, b - a) for a, b in zip(cuts, cuts[1:])]

    def after_segment(self, step: int) -> None:
        """At the boundary after `step` steps of an asynchronous schedule (the pipeline drained): agree
        through one allreduce whether a rank was signalled; checkpoint (with --checkpoint-dir); stop if agreed."""
        self.guard.flush_pending()  # the lagged check: the segment's last update is settled before its checkpoint
        if not self.args.checkpoint_dir:
            return
        mine = np.zeros(2, dtype=np.int64)
        if self.signals.signum:
            mine[0], mine[1] = self.signals.signum, self.comm.rank + 1
        every = self.comm.allreduce_max(mine)
        if step != self.saved_step:
            self._checkpoint(step)
        if every[0]:
            name = signal.Signals(int(every[0])).name
            where = f"; checkpoint saved in {self.saved} (resume with --resume)" if self.saved is not None else ""
            raise StopTraining(f"stopped by {name} (received by rank {int(every[1]) - 1}) after step {step}{where}",
                               128 + int(every[0]))

    def after_step(self, step: int) -> None:
        """At the boundary after `step` steps (flush schedules; the guard agreed at their STEP):
        checkpoint if due, stop if agreed."""
        self.done = step
        if not self.engine.flush:
            return
        g = self.guard
        signalled = g.stop_reason is not None and g.exit_code > 128
        every = self.args.checkpoint_every
        due = (every and step % every == 0) or step == self.args.steps or signalled
        if g.lagged and (step == self.args.steps or (self.args.checkpoint_dir and due)):
            g.flush_pending()  # a checkpoint (or the end) must know this step's flags: all ranks call this
        if self.args.checkpoint_dir and due and g.exit_code != EXIT_NONFINITE and step != self.saved_step:
            self._checkpoint(step)
        if g.stop_reason is not None:
            self.engine.update.close()  # every rank stops here: nothing left in flight at the teardown (shard.py)
            where = ""
            if self.saved is not None and self.saved_step == step and g.exit_code != EXIT_NONFINITE:
                where = f"; checkpoint saved in {self.saved} (resume with --resume)"
            raise StopTraining(g.stop_reason + where, g.exit_code)

    def _checkpoint(self, step: int) -> None:
        """Collective save; a failed one (disk full, directory gone) ends the run on every rank with its one line."""
        from pipeflow import checkpoint

        assert self.args.checkpoint_dir is not None  # called only with --checkpoint-dir
        try:
            self.saved = checkpoint.save(self.engine, self.args.checkpoint_dir, step, self.comm, self.run_info,
                                         skipped=(self.guard.consecutive, self.guard.skipped_in_all))
        except checkpoint.CheckpointError as e:
            raise AgreedError(str(e)) from None
        self.saved_step = step
        if self.comm.rank == 0:
            log.info("checkpoint %s", self.saved)

    def close(self) -> None:
        self.signals.restore()
        if self.immediate is not None:
            self.immediate.restore()
