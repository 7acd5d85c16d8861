"""Gantt chart of a simulated schedule: one row per rank, forward / backward / weight gradient (W of a split
backward, zero bubble) / all-reduce / idle coloured."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from partitioner.planner import PlanningError

if TYPE_CHECKING:
    from partitioner.service import Planned

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "STEP": "#8172b3"}
IDLE = "#eeeeee"


def check_format(path: str) -> None:
    """PlanningError unless matplotlib is installed and can write `path`, by its ending, as draw() saves it
    (savefig takes the format from the ending, and without one writes PATH.png instead)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise PlanningError("--timeline needs matplotlib: pip install matplotlib") from None
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if Path(path).suffix.lower().removeprefix(".") not in formats:
        raise PlanningError(f"--timeline must end in a format matplotlib writes (.{', .'.join(formats)}), found "
                            f"{path!r}")


def draw(planned: Planned, path: str) -> None:
    """Write the simulated timeline of the plan to `path` (PNG); rows are the plan's ranks."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise PlanningError("--timeline needs matplotlib: pip install matplotlib") from None
    sim, plan = planned.sim, planned.plan
    sched = sim.schedule
    # Simulator worker (stage, replica) -> the plan's rank for that replica.
    rank_of = {w: plan.stages[s].ranks[r] for w, (s, r) in enumerate(sched.workers)}
    end = max((iv.end for iv in sim.timeline), default=1.0)
    n = plan.workers
    fig, ax = plt.subplots(figsize=(min(24.0, 6 + 0.05 * len(sim.timeline) / max(1, n)), 1 + 0.4 * n))
    for w in range(len(sched.workers)):
        ax.broken_barh([(0, end)], (rank_of[w] - 0.4, 0.8), facecolors=IDLE)
    for iv in sim.timeline:
        if iv.end > iv.start:
            y = rank_of[iv.worker]
            ax.broken_barh([(iv.start, iv.end - iv.start)], (y - 0.4, 0.8), facecolors=COLOURS[iv.kind],
                           edgecolor="white", linewidth=0.3)
            if iv.microbatch is not None and n <= 16:
                ax.text((iv.start + iv.end) / 2, y, str(iv.microbatch), ha="center", va="center", fontsize=6,
                        color="white")
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r} (stage {plan.stage_of_rank(r)[0]})" for r in range(n)])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"{plan.schedule}, {plan.microbatches} microbatches: step {plan.predicted['step_ms']:.2f} ms, "
                 f"bubble {100 * plan.predicted['bubble_fraction']:.1f}%")
    split = any(iv.kind == "W" for iv in sim.timeline)
    ax.legend(handles=[Patch(color=COLOURS["F"], label="forward"),
                       Patch(color=COLOURS["B"], label="backward (input gradient: B)" if split else "backward"),
                       *([Patch(color=COLOURS["W"], label="weight gradient (W)")] if split else []),
                       Patch(color=COLOURS["STEP"], label="all-reduce / step"), Patch(color=IDLE, label="idle")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
