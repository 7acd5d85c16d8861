"""Throughput monitoring: measured spans per stage, TensorBoard scalars, a Chrome trace and the progress bar."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from partitioner.plan import Plan
from pipeflow.engine import Timer

log = logging.getLogger(__name__)

COMPUTE = ("F", "B")  # what counts as work in the bubble; everything else is waiting or overhead
CATEGORY = {"F": "compute", "B": "compute", "STEP": "optimizer", "SEND_F": "comm", "SEND_B": "comm",
            "WAIT_F": "comm", "WAIT_B": "comm"}
PREDICTED = ("step_ms", "bubble_fraction", "samples_per_s")  # plan.predicted keys logged as predicted/<key>


@dataclass
class Span:
    """One measured action, in seconds since the monitor's zero (the barrier at start, common to all ranks)."""

    kind: str
    mb: int | None
    step: int
    start: float
    end: float


class SpanTimer(Timer):
    """Records every span of the engine. On CPU, host perf_counter; on CUDA, a pair of events on the current
    stream, turned into times only in `resolve` (at report time), so the steady state never syncs the host."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.step = 0
        self.t0 = time.perf_counter()
        self.ref: Any = None  # CUDA: the event that marks time zero
        self._spans: list[tuple[str, int | None, int, Any, Any]] = []
        self._steps: list[tuple[int, Any, Any]] = []  # (step, begin, end), unresolved
        self._begin: Any = self._now()

    def _now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _seconds(self, mark: Any) -> float:
        return float(self.ref.elapsed_time(mark)) / 1e3 if self.cuda else mark - self.t0

    def reset(self, step: int = 0) -> None:
        """Time zero is now (call right after a barrier) and `step` comes next; drops anything recorded."""
        if self.cuda:
            torch.cuda.synchronize()  # once, at start: the zero event then runs when the host says
        self.t0 = time.perf_counter()
        self.ref = self._now()
        self._spans.clear()
        self._steps.clear()
        self.step = step
        self._begin = self._now()

    @contextlib.contextmanager
    def span(self, kind: str, mb: int | None = None) -> Iterator[None]:
        start = self._now()
        yield
        self._spans.append((kind, mb, self.step, start, self._now()))

    def end_step(self, step: int) -> None:
        """Step `step` ends now; it began where the previous one ended, so a stage's step time is its period
        (what throughput sees), the monitor's own report time included as idle."""
        end = self._now()
        self._steps.append((step, self._begin, end))
        self._begin = end
        self.step = step + 1

    def resolve(self) -> tuple[list[Span], list[tuple[int, float, float]]]:
        """The spans and step intervals recorded since the last call, in seconds. Syncs the device on CUDA."""
        if self.cuda:
            torch.cuda.synchronize()
        spans = [Span(k, mb, st, self._seconds(a), self._seconds(b)) for k, mb, st, a, b in self._spans]
        steps = [(st, self._seconds(a), self._seconds(b)) for st, a, b in self._steps]
        self._spans.clear()
        self._steps.clear()
        return spans, steps


def step_metrics(spans: list[Span], begin: float, end: float) -> dict[str, float]:
    """Per-step times (ms) of one rank from its spans; idle is what is neither compute nor comm wait."""
    ms = {k: 0.0 for k in CATEGORY}
    for s in spans:
        ms[s.kind] = ms.get(s.kind, 0.0) + (s.end - s.start) * 1e3
    wall = max((end - begin) * 1e3, 1e-9)
    compute = sum(ms[k] for k in COMPUTE)
    wait = ms["WAIT_F"] + ms["WAIT_B"]
    return {"time/forward_ms": ms["F"], "time/backward_ms": ms["B"], "time/comm_wait_ms": wait,
            "time/optimizer_ms": ms["STEP"], "time/idle_ms": max(wall - compute - wait, 0.0),
            "time/step_ms": wall, "pipeline/bubble_fraction": min(max(1.0 - compute / wall, 0.0), 1.0)}


def window_metrics(spans: list[Span], steps: list[tuple[int, float, float]]) -> dict[str, float]:
    """The mean of step_metrics over the steps of one report window."""
    by_step: dict[int, list[Span]] = {}
    for s in spans:
        by_step.setdefault(s.step, []).append(s)
    rows = [step_metrics(by_step.get(k, []), b, e) for k, b, e in steps]
    return {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]} if rows else {}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def clock_offset(comm: Any, rounds: int = 32) -> float:
    """This rank's perf_counter minus rank 0's. Ranks of one host share the clock (CLOCK_MONOTONIC): 0 apart.
    Each other host's first rank is measured by Cristian's algorithm (rank 0 asks for its clock; the round trip
    with the least delay gives the estimate) and its host follows. A barrier alone leaves ranks milliseconds
    apart when they share cores."""
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    leader = {h: hosts.index(h) for h in hosts}
    offsets = [0.0] * size
    for r in sorted(set(leader.values()) - {leader[hosts[0]]}):
        best = math.inf
        for _ in range(rounds):
            if rank == 0:
                t1 = time.perf_counter()
                comm.send(None, dest=r, tag=1)
                tr = comm.recv(source=r, tag=2)
                t2 = time.perf_counter()
                if t2 - t1 < best:
                    best, offsets[r] = t2 - t1, tr - (t1 + t2) / 2
            elif rank == r:
                comm.recv(source=0, tag=1)
                comm.send(time.perf_counter(), dest=0, tag=2)
    offsets = [offsets[leader[h]] for h in hosts]
    return float(comm.scatter(offsets, root=0))


def chrome_trace(ranks: list[tuple[int, int, list[Span]]], *, title: str = "pipeflow") -> dict[str, Any]:
    """Chrome trace events (Perfetto, chrome://tracing): one process, one row (tid) per rank, a complete
    ("X") event per span named like the schedule's actions (F3, B3, SEND_F3, STEP)."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}]
    for rank, stage, spans in sorted(ranks, key=lambda r: r[0]):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank} (stage {stage})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}})
        for s in spans:
            args: dict[str, Any] = {"step": s.step}
            if s.mb is not None:
                args["microbatch"] = s.mb
            events.append({"name": s.kind if s.mb is None else f"{s.kind}{s.mb}", "cat": CATEGORY.get(s.kind, "other"),
                           "ph": "X", "pid": 0, "tid": rank, "ts": round(s.start * 1e6, 3),
                           "dur": round((s.end - s.start) * 1e6, 3), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class Progress:
    """On the rank that owns the loss: a live bar on a terminal, one log line per report otherwise."""

    def __init__(self, total: int, samples_per_step: int, tokens_per_sample: int = 0, *,
                 stream: TextIO | None = None) -> None:
        self.total, self.sps, self.tps = total, samples_per_step, tokens_per_sample
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start()

    def start(self, step: int = 0) -> None:
        """Training (re)starts after `step` steps (a resumed run: the rate and ETA count from here)."""
        self.t0 = self.last_t = time.perf_counter()
        self.first_step = self.last_step = step

    def update(self, step: int, loss: float | None) -> float:
        """Show step `step`; returns samples/s since the previous update."""
        now = time.perf_counter()
        rate = (step - self.last_step) * self.sps / max(now - self.last_t, 1e-9)
        self.last_t, self.last_step = now, step
        elapsed = now - self.t0
        done = step - self.first_step
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        tok = f" {rate * self.tps / 1000:,.1f}k tok/s" if self.tps else ""
        text = f"loss {loss:.4f}" if loss is not None else "loss -"
        if self.tty:
            width = 24
            bar = int(width * step / self.total)
            self.stream.write(f"\r[{'#' * bar}{'.' * (width - bar)}] {step}/{self.total} | {text} | "
                              f"{rate:,.1f} samples/s{tok} | {_clock(elapsed)}<{_clock(eta)}\x1b[K")
            if step == self.total:
                self.stream.write("\n")
            self.stream.flush()
        else:
            log.info("step %d/%d  %s  %.1f samples/s%s  elapsed %s, eta %s", step, self.total, text, rate, tok,
                     _clock(elapsed), _clock(eta))
        return rate


class Board:
    """The one TensorBoard writer, on the rank that owns the loss. Run-wide scalars go to DIR and each stage's
    to the run DIR/stageS under the same tags, so TensorBoard draws one chart per metric, a line per stage."""

    def __init__(self, logdir: str, num_stages: int, *, text: str = "", first_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run adds event files beside the first run's; purge_step hides what the first run logged
        # after the checkpoint it resumes from (those steps are trained again).
        purge = first_step + 1 if first_step else None
        self.main = SummaryWriter(logdir, flush_secs=30, purge_step=purge)
        self.stages = [SummaryWriter(os.path.join(logdir, f"stage{s}"), flush_secs=30, purge_step=purge)
                       for s in range(num_stages)]
        if text:
            self.main.add_text("config", text, 0)

    def write(self, step: int, scalars: dict[str, float], stages: list[dict[str, float]]) -> None:
        for tag, v in scalars.items():
            self.main.add_scalar(tag, v, step)
        for w, row in zip(self.stages, stages):
            for tag, v in row.items():
                w.add_scalar(tag, v, step)
        for w in (self.main, *self.stages):
            w.flush()  # once per report: the run is live in TensorBoard

    def close(self) -> None:
        for w in (self.main, *self.stages):
            w.close()


def describe(plan: Plan, argv: dict[str, Any]) -> str:
    """Markdown for the TensorBoard text tab: the flags and the plan's stages."""
    rows = ["| stage | layers | ranks |", "|---|---|---|"]
    rows += [f"| {s} | {st.layers[0]}..{st.layers[1] - 1} | {st.ranks} |" for s, st in enumerate(plan.stages)]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in argv.items() if v not in (None, False))
    return (f"`{flags}`\n\nschedule **{plan.schedule}**, {plan.microbatches} microbatches\n\n" + "\n".join(rows)
            + (f"\n\npredicted: `{json.dumps(plan.predicted)}`" if plan.predicted else ""))


class Monitor:
    """Everything a training run reports. Every rank records its spans (only with --tensorboard or --trace);
    at each loss report the stages' window metrics are gathered over MPI to the rank that owns the loss,
    which writes them; the trace is gathered on rank 0 at the end. Create it on all ranks at the same point."""

    def __init__(self, comm: Any, plan: Plan, device: torch.device, *, total_steps: int, samples_per_step: int,
                 tokens_per_sample: int = 0, tensorboard: str | None = None, trace: str | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.comm = comm.Dup()  # its own communicator: these collectives never meet the runtime's messages
        self.rank = self.comm.Get_rank()
        self.plan, self.device = plan, device
        self.stage, self.replica = plan.stage_of_rank(self.rank)
        self.owner = plan.stages[-1].ranks[0]
        self.tensorboard, self.trace_path = tensorboard, trace
        self.recording = bool(tensorboard or trace)
        self.timer: Timer = SpanTimer(device) if self.recording else Timer()
        self.trace_spans: list[Span] = []
        self.clock_shift = 0.0  # add to this rank's span times to put them on rank 0's time axis
        self.samples_per_step, self.tokens_per_sample = samples_per_step, tokens_per_sample
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

    def report(self, step: int, loss: float | None, *, lr: float | None = None) -> None:
        """At a loss report (1-based `step`): progress, and with --tensorboard the window's scalars."""
        rate = self.progress.update(step, loss) if self.progress is not None else 0.0
        if not isinstance(self.timer, SpanTimer):
            return
        spans, steps = self.timer.resolve()
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
        if loss is not None and math.isfinite(loss):
            scalars["loss/train"] = loss
        if lr is not None:
            scalars["lr"] = lr
        if rate > 0:
            scalars["time/step_ms"] = 1e3 * self.samples_per_step / rate
        bubbles = [r["pipeline/bubble_fraction"] for r in stages if "pipeline/bubble_fraction" in r]
        if bubbles:
            scalars["pipeline/bubble_fraction"] = sum(bubbles) / len(bubbles)
        for key in PREDICTED:
            if isinstance(self.plan.predicted.get(key), (int, float)):
                scalars[f"predicted/{key}"] = float(self.plan.predicted[key])
        self.board.write(step, scalars, stages)

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


def append_trace(path: str, new: dict[str, Any], first_step: int) -> dict[str, Any]:
    """The trace at `path` (a run this one resumed) followed by `new`: the first run's spans of steps before
    `first_step` (later ones are trained again), then this run's as another process (pid) shifted to start
    after them. A missing or foreign file gives `new` alone."""
    try:
        with open(path) as f:
            old = json.load(f)
        events = old["traceEvents"]
        if not isinstance(events, list) or not all(isinstance(ev, dict) for ev in events):
            raise TypeError("traceEvents is not a list of objects")
    except FileNotFoundError:
        return new
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("--trace %s: not a trace this run can append to (%s); writing this run's alone", path, e)
        return new
    kept = [e for e in events if e.get("ph") != "X" or e.get("args", {}).get("step", 0) < first_step]
    end = max((e["ts"] + e.get("dur", 0) for e in kept if e.get("ph") == "X"), default=0.0)
    pid = 1 + max((e.get("pid", 0) for e in kept), default=0)
    shift = end + 1000.0  # µs: a visible gap between the runs
    out = []
    for ev in new["traceEvents"]:
        ev = {**ev, "pid": pid}
        if "ts" in ev:
            ev["ts"] = round(ev["ts"] + shift, 3)
        out.append(ev)
    return {**new, "traceEvents": kept + out}
