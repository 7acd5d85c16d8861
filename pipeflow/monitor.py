"""Throughput monitoring: measured spans per stage, TensorBoard scalars, a Chrome trace and the progress bar."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from partitioner.plan import Plan
from pipeflow.board import Board, describe
from pipeflow.hooks import Timer, Timing
from pipeflow.mfu import mfu
from pipeflow.progress import Progress
from pipeflow.spans import (  # noqa: F401  (step_metrics: tests import it from here)
    Span,
    SpanTimer,
    peak_memory_bytes,
    step_metrics,
    window_metrics,
)
from pipeflow.trace import append_trace, chrome_trace, clock_offset

log = logging.getLogger(__name__)

PREDICTED = ("step_ms", "bubble_fraction", "samples_per_s")  # plan.predicted keys logged as predicted/<key>


class Monitor:
    """Everything a training run reports. Every rank records its spans (only with --tensorboard or --trace);
    at each loss report the stages' window metrics are gathered over MPI to the rank that owns the loss,
    which writes them; the trace is gathered on rank 0 at the end. Create it on all ranks at the same point."""

    def __init__(self, comm: Any, plan: Plan, device: torch.device, *, total_steps: int, samples_per_step: int,
                 tokens_per_sample: int = 0, tensorboard: str | None = None, trace: str | None = None,
                 config: dict[str, Any] | None = None, flops_per_sample: float | None = None,
                 peak_tflops: float | None = None) -> None:
        self.comm = comm.Dup()  # its own communicator: these collectives never meet the runtime's messages
        self.rank = self.comm.Get_rank()
        self.plan, self.device = plan, device
        self.stage, self.replica = plan.stage_of_rank(self.rank)
        self.owner = plan.stages[-1].ranks[0]
        self.tensorboard, self.trace_path = tensorboard, trace
        self.recording = bool(tensorboard or trace)
        self.timer: Timing = SpanTimer(device) if self.recording else Timer()
        self.trace_spans: list[Span] = []
        self.clock_shift = 0.0  # add to this rank's span times to put them on rank 0's time axis
        self.samples_per_step, self.tokens_per_sample = samples_per_step, tokens_per_sample
        self.flops_per_sample, self.peak_tflops = flops_per_sample, peak_tflops  # MFU (mfu.py) when both known
        owner = self.rank == self.owner
        self.progress = Progress(total_steps, samples_per_step, tokens_per_sample) if owner else None
        self.config = config or {}
        self.board: Board | None = None  # made in start(), which knows whether the run resumed
        self.first_step = 0

    def start(self, first_step: int = 0) -> None:
        """Line up the ranks' clocks for the trace, then start step `first_step` together (a barrier)."""
        self.first_step = first_step
        if self.tensorboard and self.rank == self.owner:
            self.board = Board(self.tensorboard, len(self.plan.stages), text=describe(self.plan, self.config),
                               first_step=first_step)
        offset = clock_offset(self.comm) if self.trace_path else 0.0
        self.comm.Barrier()
        if isinstance(self.timer, SpanTimer):
            self.timer.reset(first_step)
            t0_root = self.comm.bcast(self.timer.t0 - offset, root=0)
            self.clock_shift = self.timer.t0 - offset - t0_root
        if self.progress is not None:
            self.progress.start(first_step)

    def end_step(self, step: int) -> None:
        if isinstance(self.timer, SpanTimer):
            self.timer.end_step(step)

    def report(self, step: int, loss: float | None, *, lr: float | None = None,
               grad_norm: float | None = None, show_lr: bool = False) -> None:
        """At a loss report (1-based `step`): progress, and with --tensorboard the window's scalars; `grad_norm`:
        --clip-grad-norm's last norm (on the loss's owner); `show_lr`: the lr in the progress line too (a schedule)."""
        shown = lr if show_lr else None
        rate = self.progress.update(step, loss, grad_norm, lr=shown) if self.progress is not None else 0.0
        if not isinstance(self.timer, SpanTimer):
            return
        spans, steps = self.timer.resolve(wait=False)  # the steps the device has finished: no sync
        if self.trace_path:
            self.trace_spans += spans
        if not self.tensorboard:
            return
        mine = (self.stage, window_metrics(spans, steps), peak_memory_bytes(self.device))
        rows = self.comm.gather(mine, root=self.owner)
        if self.board is None:
            return
        stages = self._per_stage(rows)
        scalars: dict[str, float] = {"throughput/samples_per_s": rate}
        if self.tokens_per_sample > 0:
            scalars["throughput/tokens_per_s"] = rate * self.tokens_per_sample
        utilisation = mfu(rate, self.flops_per_sample, self.comm.Get_size(), self.peak_tflops)
        if utilisation is not None:
            scalars["throughput/mfu"] = utilisation
        if loss is not None and math.isfinite(loss):
            scalars["loss/train"] = loss
        if lr is not None:
            scalars["lr"] = lr
        if grad_norm is not None and math.isfinite(grad_norm):
            scalars["grad/norm"] = grad_norm
        if rate > 0:
            scalars["time/step_ms"] = 1e3 * self.samples_per_step / rate
        bubbles = [r["pipeline/bubble_fraction"] for r in stages if "pipeline/bubble_fraction" in r]
        if bubbles:
            scalars["pipeline/bubble_fraction"] = sum(bubbles) / len(bubbles)
        for key in PREDICTED:
            if isinstance(self.plan.predicted.get(key), (int, float)):
                scalars[f"predicted/{key}"] = float(self.plan.predicted[key])
        self.board.write(step, scalars, stages)

    def evaluated(self, step: int, loss: float | None, seconds: float) -> None:
        """After an evaluation at step `step` (--eval-every) that took `seconds`, on every rank: the steps' times
        leave it out; on the loss's owner (`loss`: the mean over its minibatches) the 'eval loss' line and
        TensorBoard's loss/eval."""
        if isinstance(self.timer, SpanTimer):
            self.timer.skip()
        if loss is None:
            return
        if self.progress is not None:
            self.progress.evaluated(step, loss, seconds)
        if self.board is not None and math.isfinite(loss):  # as loss/train: a NaN would hide the chart's scale
            self.board.write(step, {"loss/eval": loss}, [])

    def _per_stage(self, rows: list[tuple[int, dict[str, float], int]]) -> list[dict[str, float]]:
        """Replicas of a stage averaged (times) or maxed (memory); the plan's predicted memory beside."""
        out: list[dict[str, float]] = []
        mem = self.plan.predicted.get("peak_memory_bytes")
        for s in range(len(self.plan.stages)):
            mine = [(m, peak) for st, m, peak in rows if st == s]
            metrics = [m for m, _ in mine if m]
            row = {k: sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]} if metrics else {}
            row["memory/peak_bytes"] = float(max((p for _, p in mine), default=0))
            if isinstance(mem, list) and s < len(mem) and isinstance(mem[s], (int, float)):
                row["predicted/peak_memory_bytes"] = float(mem[s])
            out.append(row)
        return out

    def close(self) -> None:
        """Write the trace (gathered on rank 0) and close the writer. Collective: call it on every rank."""
        if self.trace_path:
            if isinstance(self.timer, SpanTimer):
                self.trace_spans += self.timer.resolve()[0]  # anything after the last report
            shift = self.clock_shift
            mine = [Span(s.kind, s.mb, s.step, s.start + shift, s.end + shift) for s in self.trace_spans]
            ranks = self.comm.gather((self.rank, self.stage, mine), root=0)
            if self.rank == 0:
                self._write_trace(ranks)
        if self.board is not None:
            self.board.close()
        self.comm.Free()

    def _write_trace(self, ranks: list[tuple[int, int, list[Span]]]) -> None:
        """Rank 0: the trace file; a resumed run appends to the first run's (append_trace). A write that fails
        after the set-up check passed (the directory vanished, the disk filled) is one error line, not a traceback."""
        from pipeflow.checkpoint import atomic_write, reason

        title = f"pipeflow {self.plan.schedule}, {self.plan.microbatches} microbatches"
        if self.first_step:
            title += f", resumed at step {self.first_step}"
        trace = chrome_trace(ranks, title=title)
        if self.first_step:
            trace = append_trace(self.trace_path or "", trace, self.first_step)
        try:
            atomic_write(Path(self.trace_path or ""), lambda f: f.write(json.dumps(trace).encode()))
        except OSError as e:
            log.error("cannot write the trace to %s: %s", self.trace_path, reason(e))
            return
        log.info("trace of %d ranks written to %s (open it in https://ui.perfetto.dev)", len(ranks), self.trace_path)
