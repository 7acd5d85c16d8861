"""PipeDream's partitioning DP (SOSP'19 §3.1), hierarchical and vectorized with numpy; pure (no torch).

The DP tabulates, for every suffix of layers on w top-level units (and, on inner levels, every layer range
on w units of one group), the least lower bound of the simulated step time any plan of it can reach, under
the cost model of partitioner/costmodel.py (its docstring gives the bound). The search (search.py) walks
plans in order of these bounds and lets the simulator decide. Plans are trees (partitioner/tree.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from partitioner.bands import WIDTH, Bands
from partitioner.costmodel import INF, OPTIMIZER_STATES, SCHEDULES, CostModel, LayerCosts, PlanningError
from partitioner.tree import LeafStage, Node, Solution, evaluate, flatten

# The planner's names, importable from here as before the split (issue 12).
__all__ = ["INF", "OPTIMIZER_STATES", "SCHEDULES", "CostModel", "LayerCosts", "LeafStage", "Node", "PlanningError",
           "Progress", "Solution", "Tables", "evaluate", "flatten", "solve", "tabulate"]



class Progress:
    """Reports how far the DP is, at most every `every_s` seconds and only once it has run that long
    (a legitimate large plan may take minutes: say so rather than look hung)."""

    def __init__(self, report: Callable[[str], None] | None = None, every_s: float = 5.0) -> None:
        self.report, self.every_s = report, every_s
        self.start = self.last = time.monotonic()

    def tick(self, level: int, done: int, total: int) -> None:
        now = time.monotonic()
        if self.report is not None and now - self.last >= self.every_s:
            self.last = now
            self.report(f"planning level {level}: {done}/{total} first layers done, {now - self.start:.0f} s")


class _Level:
    """All-pairs table of one inner level: best[w, i, j] for layers [i, j) on exactly w of its units."""

    def __init__(self, model: CostModel, level: int, inner: np.ndarray | None,
                 progress: Progress | None = None) -> None:
        self.model, self.level, self.inner = model, level, inner
        n, L = model.topology.levels[level].workers, model.num_layers
        self.n = n
        # WIDTH spare columns: Bands reads whole blocks of columns past j = L.
        best = np.full((n + 1, L + 1, L + 1 + WIDTH), INF)
        rs = np.arange(1, n + 1, dtype=np.float64)[:, None]
        bands = Bands(best, model.microbatches * model.C, float(model.topology.unit_size(level)))
        # Memory cuts a stage of r units differently for each w of the range (fit): then each w has its own left.
        per_w = level == 0 and model.memory_per_worker is not None
        for i in range(L - 1, -1, -1):
            ks = np.arange(i + 1, L + 1)
            rows = model.stage_rows(level, i, ks, n, inner)
            stages = [model.fit(level, i, ks, w, rows) for w in range(1, n + 1)]
            for w in range(1, n + 1):
                best[w, i, i + 1:L + 1] = stages[w - 1][w - 1]  # one stage on all w units
            if n > 1 and i + 1 < L:
                # First stage [i, k) on w' units, the rest [k, j) on w - w', for k in (i, L), j in (i + 1, L].
                bounds = model.port_ms(i, ks[None, :-1], rs[:-1], level)
                if per_w:
                    left = np.full((n - 1, n - 1, L - i - 1), INF)
                    for w in range(2, n + 1):
                        left[w - 2, :w - 1] = np.maximum(stages[w - 1][: w - 1, :-1], bounds[: w - 1])
                else:
                    left = np.maximum(rows[:-1, :-1], bounds)
                # Per w', a lower bound of the first stage's cost (of every w: memory only adds inf) that never
                # decreases with k (suffix min).
                base = np.minimum.accumulate(rows[:-1, :-1][:, ::-1], axis=1)[:, ::-1]
                bands.minmax(i, left, base)
            if progress is not None:
                progress.tick(level, L - i, L)
        self.best = best[:, :, :L + 1]

    def table(self) -> np.ndarray:
        return self.best[self.n]

    def trace(self, i: int, j: int, w: int) -> list[tuple[int, int, int]]:
        """Stages (start, end, units) of the optimum, recomputing the candidates (max/min are exact)."""
        model, target = self.model, self.best[w, i, j]
        ks = np.arange(i + 1, j + 1)
        if model.stage_row(self.level, i, ks, w, self.inner)[w - 1, -1] == target:
            return [(i, j, w)]
        left = model.split_row(self.level, i, ks[:-1], w, self.inner)
        for w1 in range(1, w):
            for t, k in enumerate(ks[:-1]):
                if max(left[w1 - 1, t], self.best[w - w1, k, j]) == target:
                    return [(i, int(k), w1), *self.trace(int(k), j, w - w1)]
        raise AssertionError(f"DP trace failed at level {self.level}, [{i}, {j}) on {w}")


@dataclass
class Tables:
    """What the DP leaves for the search: the inner levels' tables and the top level's suffix table."""

    model: CostModel
    levels: list[_Level]
    inner: np.ndarray | None  # the level below the top: best bound of [i, j) on one of its groups
    best: np.ndarray  # best[w, i]: the least bound of layers [i, L) on w top-level units

    @property
    def top(self) -> int:
        return len(self.model.topology.levels) - 1

    def trace(self) -> list[tuple[int, int, int]]:
        """Top-level stages (start, end, units) of the least bound; PlanningError when every bound is inf."""
        model, best, inner, top, L = self.model, self.best, self.inner, self.top, self.model.num_layers
        n = model.topology.levels[top].workers
        if not np.isfinite(best[n, 0]):
            raise PlanningError("no plan")  # the caller explains (plan_from_profile)
        stages, i, w = [], 0, n
        while w:
            ks = np.arange(i + 1, L + 1)
            if model.stage_row(top, i, ks[-1:], w, inner)[w - 1, 0] == best[w, i]:
                stages.append((i, L, w))
                break
            left = model.split_row(top, i, ks[:-1], w, inner)
            w1, t = next((w1, t) for w1 in range(1, w) for t in range(len(ks) - 1)
                         if max(left[w1 - 1, t], best[w - w1, ks[t]]) == best[w, i])
            stages.append((i, int(ks[t]), w1))
            i, w = int(ks[t]), w - w1
        return stages

    def solution(self, stages: list[tuple[int, int, int]]) -> Solution:
        """The plan of these top-level stages (start, end, units), each running its inner optimum."""
        tree = _build(self.levels, self.top, stages)
        return Solution(evaluate(self.model, tree), tree, flatten(tree, self.model.topology))


def tabulate(model: CostModel, progress: Progress | None = None) -> Tables:
    """Level by level (PipeDream's hierarchical optimizer): inner levels tabulate every layer range on one
    group; the outermost level runs a suffix DP over (first layer, units left)."""
    topo, L = model.topology, model.num_layers
    levels: list[_Level] = []
    inner: np.ndarray | None = None
    for k in range(len(topo.levels) - 1):
        levels.append(_Level(model, k, inner, progress))
        inner = levels[-1].table()
    top = len(topo.levels) - 1
    n = topo.levels[top].workers
    best = np.full((n + 1, L + 1), INF)  # best[w, i]: layers [i, L) on w units
    rs = np.arange(1, n + 1, dtype=np.float64)[:, None]
    for i in range(L - 1, -1, -1):
        ks = np.arange(i + 1, L + 1)
        rows = model.stage_rows(top, i, ks, n, inner)
        bounds = model.port_ms(i, ks[None, :-1], rs, top)
        for w in range(1, n + 1):
            stage = model.fit(top, i, ks, w, rows)
            single = stage[w - 1, -1]
            if w > 1 and i + 1 < L:
                left = np.maximum(stage[: w - 1, :-1], bounds[: w - 1])
                single = min(single, float(np.maximum(left, best[w - 1:0:-1, i + 1:L]).min()))
            best[w, i] = single
        if progress is not None:
            progress.tick(top, L - i, L)
    return Tables(model, levels, inner, best)


def solve(model: CostModel) -> Solution:
    """The plan of the least bound (PipeDream's optimum under this cost model)."""
    tables = tabulate(model)
    sol = tables.solution(tables.trace())
    return Solution(float(tables.best[model.topology.levels[tables.top].workers, 0]), sol.tree, sol.stages)


def _build(levels: list[_Level], level: int, stages: list[tuple[int, int, int]]) -> Node:
    out: list[tuple[int, int, int, Node | None]] = []
    for a, b, u in stages:
        child = None
        if level > 0:
            below = levels[level - 1]
            child = _build(levels, level - 1, below.trace(a, b, below.n))
        out.append((a, b, u, child))
    return Node(level, out)
