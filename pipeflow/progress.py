"""The progress bar (a terminal) or progress lines (a log) of the rank that owns the loss."""
from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("pipeflow.monitor")  # the name these lines had before monitor.py was split


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

    def update(self, step: int, loss: float | None, grad_norm: float | None = None, *,
               lr: float | None = None) -> float:
        """Show step `step` (with --clip-grad-norm, the last gradient's norm before clipping; with a learning-rate
        schedule, its lr); returns samples/s since the previous update."""
        now = time.perf_counter()
        rate = (step - self.last_step) * self.sps / max(now - self.last_t, 1e-9)
        self.last_t, self.last_step = now, step
        elapsed = now - self.t0
        done = step - self.first_step
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        tok = f" {rate * self.tps / 1000:,.1f}k tok/s" if self.tps else ""
        text = f"loss {loss:.4f}" if loss is not None else "loss -"
        if lr is not None:
            text += f"  lr {lr:.4g}"
        if grad_norm is not None:
            text += f"  grad norm {grad_norm:.4g}"
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

    def evaluated(self, step: int, loss: float, seconds: float) -> None:
        """An evaluation after step `step` (--eval-every) took `seconds`: its line; samples/s leaves that time out."""
        self.last_t += seconds
        if self.tty:
            self.stream.write(f"\r{step}/{self.total} | eval loss {loss:.4f}\x1b[K\n")
            self.stream.flush()
        else:
            log.info("step %d/%d  eval loss %.4f  (%.2f s)", step, self.total, loss, seconds)
