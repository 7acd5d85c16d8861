"""Non-finite checks at every STEP, and the agreement of all ranks on skipping a step or stopping."""
from __future__ import annotations

import logging
import signal
from typing import Any

import numpy as np
import torch

from pipeflow.failure import EXIT_NONFINITE, NonFiniteError
from pipeflow.hooks import arm_device_skip, supports_device_skip
from pipeflow.signals import SignalStop
from pipeflow.tensorops import nonfinite_flag

log = logging.getLogger("pipeflow.failure")  # the name these lines had before failure.py was split: log lines unchanged


class StepGuard:
    """Runs at every STEP, before the optimizer: checks this stage's gradients (and the last stage's
    losses) for NaN/inf with one host sync, and at step boundaries agrees with all ranks, through one
    MPI allreduce, whether to apply the step and whether to stop (a signal or a non-finite value).

    Flush schedules agree at every STEP, so all stages skip a bad step together. Asynchronous ones
    step per microbatch and drain only at segment boundaries (Supervisor.after_segment agrees on
    signals there), so there is no common boundary per update: a stage skips its own
    non-finite update (--skip-nonfinite) or raises NonFiniteError, which ends the job through MPI Abort.
    """

    def __init__(self, engine: Any, comm: Any, signals: SignalStop, *, skip_nonfinite: bool,
                 agree_every_step: bool, max_skips: int = 0) -> None:
        self.engine, self.comm, self.signals = engine, comm, signals
        self.skip = skip_nonfinite
        # --max-skips: a run that skips this many steps in a row does not recover; stop it (exit 4)
        # instead of "training" to the end on NaN (0: never).
        self.max_skips = max_skips
        self.consecutive = 0  # skipped in a row, up to the last agreement (flush) or update (async)
        self.agree_every_step = agree_every_step
        self.stages = engine.S
        actions = engine.actions
        # Losses this worker appends per STEP (flush: its forwards; async: one per microbatch).
        self.losses_per_step = max(1, sum(a.kind == "F" for a in actions) // max(1, sum(a.kind == "STEP"
                                                                                        for a in actions)))
        self.step = 0          # STEPs (optimizer steps taken or skipped) so far, on this worker, from the run's start
        self.bad_loss = False  # since the last agreement
        self.bad_grad = False
        self.skipped: list[int] = []  # the STEPs skipped in this process
        self.skipped_before = 0  # ... and before it, up to the checkpoint it resumed from (resume)
        self.stop_reason: str | None = None
        self.exit_code = 0
        # On GPUs with a fused optimizer the check needs no host sync: the optimizer skips a non-finite
        # update on the device (its found_inf input, as under AMP's GradScaler), the flags are copied to
        # pinned memory, and the host reads them one STEP later, when that copy has long landed. Flush
        # schedules then agree on them a step late; asynchronous ones stop (or log the skip) an update late,
        # each stage's skip being its own anyway. Flush schedules with --skip-nonfinite keep the synchronous
        # check: every stage must skip the same step, so they must agree before the update.
        opt = engine.optimizer
        self.lagged = (not (agree_every_step and skip_nonfinite) and engine.world.device.type == "cuda"
                       and supports_device_skip(opt))
        self.pending: list[tuple[int, torch.Tensor, Any]] = []  # (step, host [bad_grad, bad_loss], event)
        self._free: list[tuple[torch.Tensor, Any]] = []  # settled (host, event) pairs, reused by _lagged
        self._ones: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def resume(self, step: int, *, in_a_row: int = 0, in_all: int = 0) -> None:
        """Go on from a checkpoint after `step` minibatches as an uninterrupted run would: its STEPs counted from the
        run's start (a stage's updates under async: ScheduledLr.begin's count), so that every line names the run's
        step or update, and the skips the checkpoint recorded (restore.skipped), so that --max-skips holds across it."""
        self.step = step * self.engine.m // self.engine.microbatches_per_step
        self.consecutive, self.skipped_before = in_a_row, in_all

    @property
    def skipped_in_all(self) -> int:
        """STEPs skipped from the run's start, resumed runs included (a checkpoint records it)."""
        return self.skipped_before + len(self.skipped)

    def _device_flags(self) -> torch.Tensor:
        """[bad_grad, bad_loss] (float32) on this stage's device, without reading them: one multi-tensor
        kernel per gradient dtype (AMP's non-finite check, unscaling by exactly 1) and one over the losses."""
        e = self.engine
        dev = e.world.device
        found = nonfinite_flag((p.grad for p in e.parameters() if p.grad is not None), dev, self._ones)
        # The losses of the minibatch whose gradient this is: the latest, or those a late update holds (update.py).
        held = e.update.checking
        losses = held if held is not None else e.losses[-self.losses_per_step:]
        if e.holds_last and losses:
            bad_loss = (~torch.stack(losses).isfinite().all()).float().to(dev)
        else:
            bad_loss = torch.zeros((), dtype=torch.float32, device=dev)
        return torch.stack([found, bad_loss])

    def _local_check(self) -> tuple[bool, bool]:
        bad = self._device_flags().cpu().tolist()  # the one host sync
        return bool(bad[0]), bool(bad[1])

    def _lagged(self) -> bool:
        """The sync-free check: skip on the device now, settle the previous STEP's flags on the host."""
        flags = self._device_flags()
        arm_device_skip(self.engine.optimizer, flags.max())  # float32 0. or 1.: fused optimizers skip
        # A settled STEP's pinned buffer and event are reused: at most two are ever in use, none allocated per STEP.
        host, event = self._free.pop() if self._free else (
            torch.empty(2, dtype=torch.float32, pin_memory=flags.is_cuda),
            torch.cuda.Event() if flags.is_cuda else None)
        host.copy_(flags, non_blocking=flags.is_cuda)
        if event is not None:
            event.record()
        step = self.step
        self.step += 1
        self.pending.append((step, host, event))
        if len(self.pending) > 1:
            self._settle(*self.pending.pop(0))
        return True  # the update itself is skipped on the device when non-finite

    def _settle(self, step: int, host: torch.Tensor, event: Any) -> None:
        """Read a lagged STEP's flags (its copy landed long ago) and act on them as the synchronous check
        would have: agree (flush schedules) or stop / log the skip (asynchronous ones)."""
        if event is not None:
            event.synchronize()  # recorded a whole STEP ago: already complete in the steady state
        bad_grad, bad_loss = (bool(x) for x in host.numpy())  # a host buffer: numpy reads it without a device sync
        self._free.append((host, event))  # its copy has landed: free for a later STEP
        if self.agree_every_step:
            self.bad_grad, self.bad_loss = bad_grad, bad_loss
            if self._agree(step):
                self.skipped.append(step)
        else:
            self._update_outcome(step, bad_grad, bad_loss)

    def flush_pending(self) -> None:
        """Settle the last STEP's flags (at the end of training, a checkpoint or a segment's end)."""
        while self.pending:
            self._settle(*self.pending.pop(0))

    def __call__(self) -> bool:
        """Whether to apply this STEP's optimizer update."""
        if self.lagged:
            return self._lagged()
        bad_grad, bad_loss = self._local_check()
        self.bad_grad |= bad_grad
        self.bad_loss |= bad_loss
        step = self.step
        self.step += 1
        if self.agree_every_step:
            nonfinite = self._agree(step)
            if nonfinite:
                self.skipped.append(step)
            return not nonfinite
        return not self._update_outcome(step, bad_grad, bad_loss)

    def _update_outcome(self, step: int, bad_grad: bool, bad_loss: bool) -> bool:
        """Asynchronous schedules: this stage's update `step` was non-finite? Raise, or log its skip."""
        if bad_grad or bad_loss:
            self.skipped.append(step)
            self.consecutive += 1
            what = "loss" if bad_loss else "gradients"
            if not self.skip:
                raise NonFiniteError(f"non-finite {what} at update {step + 1} on stage {self.engine.s}; the update "
                                     "was not applied. Lower --lr, check the data, or pass --skip-nonfinite")
            if self.max_skips and self.consecutive >= self.max_skips:
                raise NonFiniteError(f"non-finite {what} at update {step + 1} on stage {self.engine.s}: "
                                     f"{self._skip_count(self.skipped_in_all)}. Lower --lr or check the data")
            log.warning("non-finite %s at update %d on stage %d: skipped (--skip-nonfinite)", what, step + 1,
                        self.engine.s)
            return True
        self.consecutive = 0
        return False

    def _skip_count(self, total: int) -> str:
        return (f"{self.consecutive} consecutive {'steps' if self.agree_every_step else 'updates'} skipped "
                f"({total} in all; --skip-nonfinite stops after --max-skips {self.max_skips} in a row), "
                "the run is not recovering")

    def _agree(self, step: int) -> bool:
        """Allreduce [signal, signalled rank, loss-bad per stage, grad-bad per stage]; True if non-finite."""
        from pipeflow.control import allreduce_max

        s = self.engine.s
        mine = np.zeros(2 + 2 * self.stages, dtype=np.int64)
        if self.signals.signum:
            mine[0], mine[1] = self.signals.signum, self.comm.Get_rank() + 1
        mine[2 + s] = self.bad_loss
        mine[2 + self.stages + s] = self.bad_grad
        self.bad_loss = self.bad_grad = False
        every = allreduce_max(self.comm, mine)
        loss_stages = [i for i in range(self.stages) if every[2 + i]]
        grad_stages = [i for i in range(self.stages) if every[2 + self.stages + i]]
        nonfinite = bool(loss_stages or grad_stages)
        if nonfinite:
            what = []
            if loss_stages:
                what.append(f"loss on stage {loss_stages[0]} (the last)")
            if grad_stages:
                what.append(f"gradients on stage{'s' if len(grad_stages) > 1 else ''} "
                            f"{', '.join(map(str, grad_stages))}")
            text = f"non-finite {' and '.join(what)} at step {step + 1}"
            if self.skip:
                self.consecutive += 1
                if self.max_skips and self.consecutive >= self.max_skips and self.stop_reason is None:
                    # This step is skipped too (the caller records it after we return).
                    count = self._skip_count(self.skipped_in_all + 1)
                    self.stop_reason = f"{text}: {count}. Lower --lr or check the data"
                    self.exit_code = EXIT_NONFINITE
                elif self.comm.Get_rank() == 0:
                    log.warning("%s: step skipped (--skip-nonfinite)", text)
            elif self.stop_reason is None:
                self.stop_reason = (f"{text}; the update was not applied. Lower --lr, check the data, or pass "
                                    "--skip-nonfinite to skip such steps")
                self.exit_code = EXIT_NONFINITE
        else:
            self.consecutive = 0
        if every[0] and self.stop_reason is None:
            name = signal.Signals(int(every[0])).name
            self.stop_reason = f"stopped by {name} (received by rank {int(every[1]) - 1}) after step {step + 1}"
            self.exit_code = 128 + int(every[0])
        return nonfinite
