"""`--schedule auto`: plan every flush schedule of the kind table and keep the one of highest predicted
throughput under the memory limit (issue 14).

Candidates are the table's records (pipeflow/kinds.py) with `flush` set, in table order: their gradients
equal single-process training's (docs/schedules.md), so the choice changes speed and memory, never the
result. The asynchronous schedules (async, 2bw) change the optimisation itself and run only when named.
A record joins automatically, and one with parameters (virtual stages, say) lists its variants in a
`variants` attribute: a tuple of keyword-argument dicts for `plan_detailed` (default one variant, no
arguments); each variant is a candidate of its own. Each candidate is planned as `--schedule NAME` would
be (microbatch count by the same rule, the simulator deciding the split) and ranked by predicted samples/s;
ties go to the lower peak memory, then to the earlier record.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from partitioner.accumulation import plan_accumulation
from partitioner.inputs import resolve_topology
from partitioner.planner import PlanningError
from partitioner.profile import Profile
from partitioner.service import Planned, plan_detailed
from partitioner.topology import Topology, format_bytes
from pipeflow.kinds import TABLE, ScheduleKind

AUTO = "auto"


@dataclass
class Candidate:
    """One schedule (and variant) tried: its plan, or why it has none."""

    schedule: str
    variant: dict[str, Any] = field(default_factory=dict)
    planned: Planned | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.variant.items())
        return f"{self.schedule}({args})" if args else self.schedule

    @property
    def peak_bytes(self) -> float:
        assert self.planned is not None
        return max(self.planned.plan.predicted["peak_memory_bytes"], default=0.0)

    def row(self) -> dict[str, Any]:
        """The candidate as plan.json records it (extra.planner.schedule_auto.candidates)."""
        out: dict[str, Any] = {"schedule": self.schedule, **({"variant": self.variant} if self.variant else {})}
        if self.planned is None:
            return {**out, "error": self.error}
        p = self.planned.plan
        return {**out, "microbatches": p.microbatches, "stages": len(p.stages), "step_ms": p.predicted["step_ms"],
                "samples_per_s": p.predicted["samples_per_s"], "bubble_fraction": p.predicted["bubble_fraction"],
                "peak_memory_bytes": self.peak_bytes}


def variants(kind: ScheduleKind) -> tuple[dict[str, Any], ...]:
    """The parameter sets a record is planned with (its `variants` attribute; one empty set by default)."""
    return tuple(dict(v) for v in getattr(kind, "variants", ()) if v) or ({},)


def candidates() -> list[Candidate]:
    """Every flush record of the kind table, one candidate per variant, in table order."""
    return [Candidate(k.name, dict(v)) for k in TABLE if k.flush for v in variants(k)]


def _key(c: Candidate, index: int) -> tuple[float, float, int]:
    assert c.planned is not None
    return (-float(c.planned.plan.predicted["samples_per_s"]), c.peak_bytes, index)


def why(winner: Candidate, tried: list[Candidate]) -> str:
    """One sentence: the winner's throughput against the runner-up's, or the tie-break that decided."""
    ok = [c for c in tried if c.planned is not None and c is not winner]
    tp = float(winner.planned.plan.predicted["samples_per_s"]) if winner.planned else 0.0
    if not ok:
        failed = "; ".join(f"{c.label}: {c.error}" for c in tried if c.planned is None)
        return f"{winner.label} is the only schedule with a plan ({failed})" if failed else \
            f"{winner.label} is the only candidate"
    second = min(ok, key=lambda c: _key(c, tried.index(c)))
    tp2 = float(second.planned.plan.predicted["samples_per_s"]) if second.planned else 0.0
    if tp > tp2:
        return (f"{winner.label} predicts {tp:.1f} samples/s, {100 * (tp / tp2 - 1) if tp2 else 100:.1f}% above "
                f"{second.label} ({tp2:.1f})")
    if winner.peak_bytes < second.peak_bytes:
        return (f"{winner.label} and {second.label} predict the same {tp:.1f} samples/s; {winner.label} needs less "
                f"memory ({format_bytes(winner.peak_bytes)} against {format_bytes(second.peak_bytes)} at the peak)")
    return (f"{winner.label} and {second.label} predict the same {tp:.1f} samples/s and memory; {winner.label} "
            "comes first in the schedule table")


def plan_auto(profile: Profile, workers: int, *, microbatches: int | str = "auto",
              topology: Topology | str | None = None, memory_per_worker: int | str | None = None,
              straight: bool = False, optimizer: str = "adam", keep_timeline: bool = False,
              shard_optimizer: bool = False) -> tuple[Planned, list[Candidate]]:
    """The plan of the best flush schedule and every candidate tried; PlanningError when none has a plan."""
    topo = resolve_topology(workers, topology, profile)  # a bad topology is no schedule's fault: refuse it once
    tried = candidates()
    for c in tried:
        try:
            c.planned = plan_accumulation(partial(
                plan_detailed, workers=workers, schedule=c.schedule, microbatches=microbatches, topology=topo,
                memory_per_worker=memory_per_worker, straight=straight, optimizer=optimizer,
                keep_timeline=keep_timeline, shard_optimizer=shard_optimizer, **c.variant), profile)
        except PlanningError as e:
            c.error = str(e)
    ok = [(i, c) for i, c in enumerate(tried) if c.planned is not None]
    if not ok:
        raise PlanningError("--schedule auto: no schedule has a plan: " +
                            "; ".join(f"{c.label}: {c.error}" for c in tried))
    winner = min(ok, key=lambda ic: _key(ic[1], ic[0]))[1]
    assert winner.planned is not None
    winner.planned.plan.extra["planner"]["schedule_auto"] = {"candidates": [c.row() for c in tried],
                                                             "why": why(winner, tried)}
    return winner.planned, tried


def plan_schedule(profile: Profile, workers: int, *, schedule: str, **kwargs: Any) -> Planned:
    """`--schedule NAME` or `--schedule auto`: the entry point of pipeflow-plan and of planning on the spot."""
    if schedule == AUTO:
        return plan_auto(profile, workers, **kwargs)[0]
    return plan_accumulation(lambda p: plan_detailed(p, workers, schedule=schedule, **kwargs), profile)


def candidates_table(planned: Planned) -> str:
    """The candidates of --schedule auto as printed by pipeflow-plan (empty when the schedule was named)."""
    auto = planned.plan.extra.get("planner", {}).get("schedule_auto")
    if not auto:
        return ""
    rows = [("schedule", "m", "stages", "step ms", "samples/s", "bubble", "peak memory")]
    notes = []
    for c in auto["candidates"]:
        label = Candidate(c["schedule"], c.get("variant", {})).label
        if "error" in c:
            rows.append((label, "-", "-", "-", "-", "-", "no plan"))
            notes.append(f"  {label}: {c['error']}")
            continue
        rows.append((label, str(c["microbatches"]), str(c["stages"]), f"{c['step_ms']:.3f}",
                     f"{c['samples_per_s']:.1f}", f"{100 * c['bubble_fraction']:.1f}%",
                     format_bytes(c["peak_memory_bytes"])))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["--schedule auto compared:"] + ["  " + "  ".join(cell.rjust(w) for cell, w in zip(r, widths))
                                             for r in rows]
    return "\n".join(lines + notes + [f"chose {planned.plan.schedule}: {auto['why']}"])
