"""The TensorBoard writer: run-wide scalars and one run per stage, and the run's description."""
from __future__ import annotations

import json
import os
from typing import Any

from partitioner.plan import Plan


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
