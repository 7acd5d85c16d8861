"""Failure handling: peer heartbeats with MPI Abort, SIGTERM/SIGINT stops, non-finite checks at STEP."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

HEARTBEAT_TAG = 0x7E57  # MPI tag of watchdog messages on COMM_WORLD; nothing else receives with ANY_TAG
ALL_TO_ALL_MAX = 16     # up to this many ranks every rank watches every other; beyond, ring neighbours
EXIT_FAILED = 3         # a peer died or stopped responding
EXIT_NONFINITE = 4      # a non-finite loss or gradient without --skip-nonfinite


class StopTraining(Exception):
    """Raised at a step boundary that every rank agreed to stop at (signal or non-finite values)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def say(text: str) -> None:
    """One line on stderr, now, in one write: the process may be aborted right after, and under
    PYTHONUNBUFFERED=1 print() writes the text and its newline separately, so that lines of
    several ranks sharing mpirun's stderr could merge."""
    sys.stderr.flush()
    os.write(2, (text.rstrip("\n") + "\n").encode())


def agree(comm: Any, error: str | None) -> str | None:
    """Share an error that may have happened on some ranks only: every rank gets the first one
    (prefixed with its rank when it happened elsewhere), or None when all succeeded."""
    errors = comm.allgather(error)
    if not any(errors):
        return None
    first = next(r for r, e in enumerate(errors) if e)
    return error or f"rank {first}: {errors[first]}"


def write_pid_file() -> None:
    """Tests find a rank's process through $PIPEFLOW_PID_DIR/rank<N>.pid (hidden; unset in normal runs)."""
    d = os.environ.get("PIPEFLOW_PID_DIR")
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
    if d:
        with open(os.path.join(d, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))


class Watchdog:
    """Heartbeats between ranks from a daemon thread, on COMM_WORLD under HEARTBEAT_TAG.

    A rank that dies or is stopped (SIGSTOP, a hung host) stops sending; its watchers print which
    rank went silent and call MPI Abort after `timeout_s`, so blocking MPI calls on the main thread
    (collectives at step boundaries, shape messages, gathers) never wait forever. A rank busy in a
    long computation keeps beating: the thread runs while torch and MPI release the GIL.
    Needs MPI_THREAD_MULTIPLE (mpi4py's default); otherwise it is off, with a warning.
    """

    def __init__(self, comm: Any, timeout_s: float) -> None:
        from mpi4py import MPI

        self.comm, self.timeout = comm, timeout_s
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.interval = min(1.0, timeout_s / 8)
        if self.size <= ALL_TO_ALL_MAX:
            peers = set(range(self.size))
        else:
            peers = {(self.rank - 1) % self.size, (self.rank + 1) % self.size}
        self.peers = sorted(peers - {self.rank})
        self.last_seen = {p: time.monotonic() for p in self.peers}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sends: list[Any] = []
        if self.peers and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            log.warning("MPI is not initialised with MPI_THREAD_MULTIPLE: dead or stopped ranks are not "
                        "detected on MPI calls (gloo transfers still time out after --timeout)")
            self.peers = []

    def start(self) -> Watchdog:
        if self.peers:
            self._thread = threading.Thread(target=self._loop, name="pipeflow-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self, *, sync: bool = False) -> None:
        """Stop beating and watching, before MPI finalises. `sync` (all ranks call it together): a
        barrier after the thread ended, so that no rank beats at a peer that has finalised."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            for r in self._sends:
                r.Wait()
            self._sends = []
            if sync:  # twice: a beat sent just before a peer's barrier may land after ours
                for _ in range(2):
                    self.comm.Barrier()
                    self._drain()

    def _drain(self) -> None:
        """Receive the heartbeats still queued: MPI_Finalize with unmatched messages can end badly."""
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=HEARTBEAT_TAG, status=status):
            self.comm.recv(source=status.Get_source(), tag=HEARTBEAT_TAG)

    def _loop(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._sends = [r for r in self._sends if not self._test(r)]
                for p in self.peers:
                    try:
                        self._sends.append(self.comm.isend(None, dest=p, tag=HEARTBEAT_TAG))
                    except Exception as e:  # MPI reports a dead peer when jobs keep running on errors
                        self._fail(p, f"sending to it failed ({e})")
                next_beat = now + self.interval
            try:
                while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=HEARTBEAT_TAG, status=status):
                    src = status.Get_source()
                    self.comm.recv(source=src, tag=HEARTBEAT_TAG)
                    self.last_seen[src] = time.monotonic()
            except Exception as e:
                self._fail(status.Get_source(), f"receiving from it failed ({e})")
            now = time.monotonic()
            silent = [(p, now - t) for p, t in self.last_seen.items() if now - t > self.timeout]
            if silent:
                p, age = max(silent, key=lambda x: x[1])
                self._fail(p, f"no heartbeat for {age:.1f} s (--timeout {self.timeout:g}); it died or is stopped")
            self._stop.wait(self.interval / 4)

    def _test(self, request: Any) -> bool:
        try:
            return bool(request.Test())
        except Exception:
            return True  # a failed send: the receiving side is judged by its own heartbeats

    def _fail(self, peer: int, why: str) -> None:
        if self._stop.is_set():
            return
        say(f"pipeflow-train: error: [rank {self.rank}] rank {peer} stopped responding: {why}. Stopping all ranks.")
        self.comm.Abort(EXIT_FAILED)

    def suspects(self, wait_s: float | None = None) -> list[int]:
        """Peers silent for more than three beats, waiting up to `wait_s` for one to show up: after a
        transfer failed, this names the rank behind it."""
        if self._thread is None:
            return []
        deadline = time.monotonic() + (4 * self.interval if wait_s is None else wait_s)
        while True:
            now = time.monotonic()
            out = sorted(p for p, t in self.last_seen.items() if now - t > 3 * self.interval)
            if out or now >= deadline:
                return out
            time.sleep(self.interval / 4)


class SignalStop:
    """SIGTERM / SIGINT set a flag that the step boundary shares with all ranks; a second signal of
    the same kind ends the process at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}

    def install(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum == signum:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum
        log.info("got %s: stopping at the next step boundary (send it again to stop at once)",
                 signal.Signals(signum).name)

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()


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
        self.step = 0          # STEPs (optimizer steps taken or skipped) so far, on this worker
        self.bad_loss = False  # since the last agreement
        self.bad_grad = False
        self.skipped: list[int] = []
        self.stop_reason: str | None = None
        self.exit_code = 0
        # On GPUs with a fused optimizer the check needs no host sync: the optimizer skips a non-finite
        # update on the device (its found_inf input, as under AMP's GradScaler), the flags are copied to
        # pinned memory, and the ranks agree on them one step later, when that copy has long landed.
        # --skip-nonfinite keeps the synchronous check: every stage must skip the same step.
        opt = engine.optimizer
        self.lagged = (agree_every_step and not skip_nonfinite and engine.world.device.type == "cuda"
                       and bool(getattr(opt, "_step_supports_amp_scaling", False)))
        self.pending: list[tuple[int, torch.Tensor, Any]] = []  # (step, pinned [bad_grad, bad_loss], event)

    def _device_flags(self) -> torch.Tensor:
        """[bad_grad, bad_loss] on this stage's device, without reading them."""
        e = self.engine
        dev = e.world.device
        grads = [p.grad for p in e.stage.parameters() if p.grad is not None]
        ok_grad = (torch.stack([g.isfinite().all() for g in grads]).all() if grads
                   else torch.ones((), dtype=torch.bool, device=dev))
        ok_loss = (torch.stack(e.losses[-self.losses_per_step:]).isfinite().all() if e.stage.last and e.losses
                   else torch.ones((), dtype=torch.bool, device=dev))
        return torch.stack([~ok_grad.to(dev), ~ok_loss.to(dev)])

    def _local_check(self) -> tuple[bool, bool]:
        bad = self._device_flags().cpu().tolist()  # the one host sync
        return bool(bad[0]), bool(bad[1])

    def _lagged(self) -> bool:
        """The sync-free check: skip on the device now, agree on the previous step's flags."""
        flags = self._device_flags()
        self.engine.optimizer.found_inf = flags.any().float()
        host = torch.empty(2, dtype=torch.bool, pin_memory=flags.is_cuda)
        host.copy_(flags, non_blocking=flags.is_cuda)
        event = torch.cuda.Event() if flags.is_cuda else None
        if event is not None:
            event.record()
        step = self.step
        self.step += 1
        self.pending.append((step, host, event))
        if len(self.pending) > 1:
            prev, prev_host, prev_event = self.pending.pop(0)
            if prev_event is not None:
                prev_event.synchronize()  # recorded a whole step ago: already complete in the steady state
            self.bad_grad, self.bad_loss = bool(prev_host[0]), bool(prev_host[1])
            if self._agree(prev):
                self.skipped.append(prev)
        return True  # the update itself is skipped on the device when non-finite

    def flush_pending(self) -> None:
        """Agree on the last step's flags (at the end of training)."""
        while self.pending:
            prev, prev_host, prev_event = self.pending.pop(0)
            if prev_event is not None:
                prev_event.synchronize()
            self.bad_grad, self.bad_loss = bool(prev_host[0]), bool(prev_host[1])
            if self._agree(prev):
                self.skipped.append(prev)

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
        if bad_grad or bad_loss:
            self.skipped.append(step)
            self.consecutive += 1
            what = "loss" if bad_loss else "gradients"
            if not self.skip:
                raise NonFiniteError(f"non-finite {what} at update {step + 1} on stage {self.engine.s}; the update "
                                     "was not applied. Lower --lr, check the data, or pass --skip-nonfinite")
            if self.max_skips and self.consecutive >= self.max_skips:
                raise NonFiniteError(f"non-finite {what} at update {step + 1} on stage {self.engine.s}: "
                                     f"{self._skip_count(len(self.skipped))}. Lower --lr or check the data")
            log.warning("non-finite %s at update %d on stage %d: skipped (--skip-nonfinite)", what, step + 1,
                        self.engine.s)
            return False
        self.consecutive = 0
        return True

    def _skip_count(self, total: int) -> str:
        return (f"{self.consecutive} consecutive {'steps' if self.agree_every_step else 'updates'} skipped "
                f"({total} in all; --skip-nonfinite stops after --max-skips {self.max_skips} in a row), "
                "the run is not recovering")

    def _agree(self, step: int) -> bool:
        """Allreduce [signal, signalled rank, loss-bad per stage, grad-bad per stage]; True if non-finite."""
        from mpi4py import MPI

        s = self.engine.s
        mine = np.zeros(2 + 2 * self.stages, dtype=np.int64)
        if self.signals.signum:
            mine[0], mine[1] = self.signals.signum, self.comm.Get_rank() + 1
        mine[2 + s] = self.bad_loss
        mine[2 + self.stages + s] = self.bad_grad
        self.bad_loss = self.bad_grad = False
        every = np.empty_like(mine)
        self.comm.Allreduce(mine, every, op=MPI.MAX)
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
                    count = self._skip_count(len(self.skipped) + 1)
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



class NonFiniteError(RuntimeError):
    """A non-finite update on one rank of an asynchronous schedule, which has no common step boundary."""


class AgreedError(Exception):
    """An error every rank raises together (after `agree`): reported on every rank, exit 2, no Abort."""


class Supervisor:
    """Glue between the step loop and the above: resume, checkpoints every K steps, stops at boundaries."""

    def __init__(self, args: Any, engine: Any, comm: Any, run_info: dict[str, Any]) -> None:
        self.args, self.engine, self.comm, self.run_info = args, engine, comm, run_info
        self.signals = SignalStop()
        self.guard = StepGuard(engine, comm, self.signals, skip_nonfinite=args.skip_nonfinite,
                               agree_every_step=engine.flush, max_skips=getattr(args, "max_skips", 0))
        self.saved_step = -1
        self.saved: Path | None = None
        self.done = 0  # steps finished on this rank
        self.immediate: Any = None  # interrupt.ImmediateStop

    def start(self) -> int:
        """Resume if asked (every rank agrees on the outcome); install the guard and signal handlers.
        Returns the number of steps already done."""
        from pipeflow import checkpoint
        from pipeflow.resume import choose

        step, error = 0, None
        if self.args.resume:
            path: Path | None = None
            try:  # the newest complete checkpoint whose files verify, the same on every rank
                path, marker = choose(self.comm, self.args.resume, self.args.checkpoint_dir)
                if path is not None:
                    step = checkpoint.load(self.engine, path, self.run_info, marker)
            except checkpoint.CheckpointError as e:
                error = str(e)
            error = agree(self.comm, error)
            if error:
                raise AgreedError(error)
            if self.comm.Get_rank() == 0:
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
        self.engine.step_guard = self.guard
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
        from mpi4py import MPI

        if not self.args.checkpoint_dir:
            return
        mine = np.zeros(2, dtype=np.int64)
        if self.signals.signum:
            mine[0], mine[1] = self.signals.signum, self.comm.Get_rank() + 1
        every = np.empty_like(mine)
        self.comm.Allreduce(mine, every, op=MPI.MAX)
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
            where = ""
            if self.saved is not None and self.saved_step == step and g.exit_code != EXIT_NONFINITE:
                where = f"; checkpoint saved in {self.saved} (resume with --resume)"
            raise StopTraining(g.stop_reason + where, g.exit_code)

    def _checkpoint(self, step: int) -> None:
        """Collective save; a failed one (disk full, directory gone) ends the run on every rank with its one line."""
        from pipeflow import checkpoint

        try:
            self.saved = checkpoint.save(self.engine, self.args.checkpoint_dir, step, self.comm, self.run_info)
        except checkpoint.CheckpointError as e:
            raise AgreedError(str(e)) from None
        self.saved_step = step
        if self.comm.Get_rank() == 0:
            log.info("checkpoint %s", self.saved)

    def close(self) -> None:
        self.signals.restore()
        if self.immediate is not None:
            self.immediate.restore()
        self.engine.step_guard = None
