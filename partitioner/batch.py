"""`--global-batch G`: the planner chooses the microbatch size b and count m with b * m = G (issue 13).

A profile may hold the model at several microbatch sizes (profile.json `other_microbatch_sizes`, from
`pipeflow-profile --microbatch-sizes 2,4,8`). For every profiled b dividing G the plan at m = G / b is made
as `--microbatches m` would make it (with `--schedule auto` too), and the one of highest predicted samples/s
under the memory limit wins: larger microbatches run the layers more efficiently, more of them shrink the
pipeline's bubble and the activations each keeps. Ties go to the lower peak memory, then the smaller b.
"""
from __future__ import annotations

from typing import Any

from partitioner.auto import plan_schedule
from partitioner.planner import PlanningError
from partitioner.profile import Profile
from partitioner.service import MAX_MICROBATCHES, Planned
from partitioner.topology import format_bytes


def plan_global_batch(profile: Profile, workers: int, *, global_batch: int, schedule: str,
                      **kwargs: Any) -> Planned:
    """The plan of the best (b, m) with b * m = global_batch over the profiled sizes; PlanningError when
    no profiled size divides it or none has a plan. The candidates go to extra.planner.global_batch."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanningError(f"--global-batch must be a positive integer, found {global_batch!r}")
    sizes = [p.microbatch_size for p in profile.at_sizes()]
    fit = [p for p in profile.at_sizes() if global_batch % p.microbatch_size == 0]
    if not fit:
        raise PlanningError(f"--global-batch {global_batch} is not a multiple of any profiled microbatch size "
                            f"({', '.join(map(str, sizes))}); profile at a size dividing it (pipeflow-profile "
                            "--microbatch-sizes)")
    rows: list[dict[str, Any]] = []
    best: tuple[tuple[float, float, int], Planned] | None = None
    for p in fit:
        b, m = p.microbatch_size, global_batch // p.microbatch_size
        row: dict[str, Any] = {"microbatch_size": b, "microbatches": m}
        rows.append(row)
        if m > MAX_MICROBATCHES:
            row["error"] = f"{m} microbatches is over the planner's limit of {MAX_MICROBATCHES}"
            continue
        try:
            got = plan_schedule(p, workers, schedule=schedule, microbatches=m, **kwargs)
        except PlanningError as e:
            row["error"] = str(e)
            continue
        pred = got.plan.predicted
        peak = max(pred["peak_memory_bytes"], default=0.0)
        row.update(schedule=got.plan.schedule, stages=len(got.plan.stages), step_ms=pred["step_ms"],
                   samples_per_s=pred["samples_per_s"], peak_memory_bytes=peak)
        key = (-float(pred["samples_per_s"]), peak, b)
        if best is None or key < best[0]:
            best = (key, got)
    if best is None:
        raise PlanningError(f"--global-batch {global_batch}: no microbatch size has a plan: " +
                            "; ".join(f"b={r['microbatch_size']}: {r['error']}" for r in rows))
    planned = best[1]
    planned.plan.extra["planner"]["global_batch"] = {"global_batch": global_batch, "candidates": rows}
    return planned


def global_batch_table(planned: Planned) -> str:
    """The (b, m) candidates of --global-batch as pipeflow-plan prints them (empty without the flag)."""
    gb = planned.plan.extra.get("planner", {}).get("global_batch")
    if not gb:
        return ""
    head = ("microbatch size", "m", "schedule", "stages", "step ms", "samples/s", "peak memory")
    rows, notes = [head], []
    for r in gb["candidates"]:
        if "error" in r:
            rows.append((str(r["microbatch_size"]), str(r["microbatches"]), "-", "-", "-", "-", "no plan"))
            notes.append(f"  b={r['microbatch_size']}: {r['error']}")
            continue
        rows.append((str(r["microbatch_size"]), str(r["microbatches"]), r["schedule"], str(r["stages"]),
                     f"{r['step_ms']:.3f}", f"{r['samples_per_s']:.1f}", format_bytes(r["peak_memory_bytes"])))
    widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
    lines = [f"--global-batch {gb['global_batch']} compared:"]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    b = planned.plan.extra["planner"]["microbatch_size"]
    return "\n".join(lines + notes + [f"chose microbatch size {b} x {planned.plan.microbatches} microbatches: "
                                      "the highest predicted samples/s under the memory limit"])
