"""Plans whose ranks hold several model chunks (interleaved 1F1B, Narayanan et al. SC'21 §2.2): the layers cut
into S*v contiguous chunks of balanced compute (an exact chain partition), chunk k placed on rank k mod S
(round-robin, one replica per rank group), priced by the simulator like every plan (price.py)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from partitioner.plan import Plan, StagePlan
from partitioner.planner import LayerCosts, PlanningError
from partitioner.price import predicted, price, schedule_rule
from partitioner.simulate import SimResult, StageCost
from partitioner.topology import Topology, format_bytes


def balanced_chunks(cost: Sequence[float], n: int) -> list[tuple[int, int]]:
    """[start, end) of n non-empty contiguous chunks of the layers minimising the largest chunk's summed
    cost (the chain partition's DP, O(n L^2)); the earliest split among equal ones."""
    L = len(cost)
    if not 1 <= n <= L:
        raise PlanningError(f"cannot split {L} layers into {n} chunks: every chunk needs at least one layer; "
                            "use fewer --virtual-stages or workers")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(cost, dtype=float))])
    best = np.full((n + 1, L + 1), np.inf)  # best[c, j]: largest chunk of layers [0, j) in c chunks
    cut = np.zeros((n + 1, L + 1), dtype=int)
    best[0, 0] = 0.0
    for c in range(1, n + 1):
        for j in range(c, L - (n - c) + 1):
            i = np.arange(c - 1, j)
            cand = np.maximum(best[c - 1, i], prefix[j] - prefix[i])
            k = int(np.argmin(cand))
            best[c, j], cut[c, j] = cand[k], i[k]
    out, j = [], L
    for c in range(n, 0, -1):
        out.append((int(cut[c, j]), j))
        j = int(cut[c, j])
    return out[::-1]


def plan_interleaved(lay: LayerCosts, topology: Topology, schedule: str, microbatches: int, workers: int,
                     virtual_stages: int, *, optimizer: str, microbatch_size: int,
                     memory_per_worker: float | None = None, keep_timeline: bool = False
                     ) -> tuple[Plan, list[StageCost], SimResult]:
    """The round-robin plan of `workers` ranks x `virtual_stages` chunks, balanced by forward + backward."""
    why = schedule_rule(schedule, microbatches, [1] * workers)
    if why:
        raise PlanningError(why)
    chunks = balanced_chunks(lay.forward_ms + lay.backward_ms, workers * virtual_stages)
    ranks = [[k % workers] for k in range(len(chunks))]
    costs, sim = price(lay, topology, schedule, microbatches, chunks, ranks, optimizer=optimizer,
                       keep_timeline=keep_timeline)
    need = max(sim.peak_memory_bytes)
    if memory_per_worker is not None and need > memory_per_worker:
        k = int(np.argmax(sim.peak_memory_bytes))
        raise PlanningError(f"no plan fits --memory-per-worker {format_bytes(memory_per_worker)}: rank {k % workers} "
                            f"holding {virtual_stages} chunks needs {format_bytes(need)}; use more workers, "
                            "fewer --virtual-stages or microbatches")
    stages = [StagePlan(c, 1, r) for c, r in zip(chunks, ranks)]
    extra = {"planner": {"topology": str(topology), "optimizer": optimizer, "microbatch_size": microbatch_size,
                         "chunks": "balanced chain partition, round-robin"}}
    return (Plan(schedule, microbatches, workers, stages, predicted(sim, microbatches, microbatch_size), extra),
            costs, sim)


def plan_interleaved_auto(lay: LayerCosts, topology: Topology, schedule: str, workers: int, virtual_stages: int,
                          *, bubble: float, most: int, **kw: object) -> tuple[Plan, list[StageCost], SimResult]:
    """--microbatches auto for interleaved plans: the smallest multiple S*2^j of the ranks (Megatron's rule)
    up to `most` whose simulated bubble is at most `bubble`; failing that, the highest throughput."""
    best = None
    m = workers
    while m <= max(most, workers):
        got = plan_interleaved(lay, topology, schedule, m, workers, virtual_stages, **kw)  # type: ignore[arg-type]
        if got[2].bubble_fraction <= bubble:
            return got
        if best is None or got[0].predicted["samples_per_s"] > best[0].predicted["samples_per_s"]:
            best = got
        m *= 2
    assert best is not None
    return best
