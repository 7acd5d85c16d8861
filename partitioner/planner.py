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
from numpy.lib.stride_tricks import sliding_window_view

from partitioner.costmodel import INF, OPTIMIZER_STATES, SCHEDULES, CostModel, LayerCosts, PlanningError
from partitioner.tree import LeafStage, Node, Solution, evaluate, flatten

# The planner's names, importable from here as before the split (issue 12).
__all__ = ["INF", "OPTIMIZER_STATES", "SCHEDULES", "CostModel", "LayerCosts", "LeafStage", "Node", "PlanningError",
           "Progress", "Solution", "Tables", "evaluate", "flatten", "solve", "tabulate"]

_MINMAX_WIDTH = 32  # columns per block in _minmax: narrower blocks give narrower bands but more of them


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
        # _MINMAX_WIDTH spare columns: _minmax reads whole blocks of columns past j = L.
        best = np.full((n + 1, L + 1, L + 1 + _MINMAX_WIDTH), INF)
        windows = sliding_window_view(best.reshape(-1), _MINMAX_WIDTH)  # a view: _minmax's rows of a block, made once
        rs = np.arange(1, n + 1, dtype=np.float64)[:, None]
        # The rest [k, j) on w'' units costs at least its work spread evenly over their workers:
        # m (C[j] - C[k]) / (w'' * unit workers) (a stage's busy time is unit * ceil(m / r) / m >= unit / r,
        # and max over stages of work / workers >= total work / total workers).
        self.work = model.microbatches * model.C
        per_unit = float(model.topology.unit_size(level))
        for i in range(L - 1, -1, -1):
            ks = np.arange(i + 1, L + 1)
            rows = model.stage_rows(level, i, ks, n, inner)
            bounds = model.port_ms(i, ks[None, :-1], rs, level)
            for w in range(1, n + 1):
                stage = model.fit(level, i, ks, w, rows)
                best[w, i, i + 1:L + 1] = stage[w - 1]  # one stage on all w units
                if w > 1 and i + 1 < L:
                    # First stage [i, k) on w' units, the rest [k, j) on w - w', for k in (i, L), j in (i + 1, L].
                    left = np.maximum(stage[: w - 1, :-1], bounds[: w - 1])
                    # Per w', a lower bound of the first stage's cost that never decreases with k (suffix min).
                    base = np.minimum.accumulate(stage[: w - 1, :-1][:, ::-1], axis=1)[:, ::-1]
                    _minmax(best, windows, w, i, left, base, self.work, rs[w - 2::-1, 0] * per_unit)
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


def _minmax(best: np.ndarray, windows: np.ndarray, w: int, i: int, left: np.ndarray, base: np.ndarray,
            work: np.ndarray, workers: np.ndarray) -> None:
    """best[w, i, j] = min(itself, min over (w', k) of max(left[w', k], best[w - w', k, j])) for j > i + 1.

    Row t of left is the split k = i + 1 + t; w' = a + 1 for row a. Columns j are taken in blocks of
    `width`, and only a band of rows per (w', block) can improve one: `base[a]` bounds left[a] from below
    and never decreases with k, so rows with base >= the block's largest current value are cut; the rest
    costs at least its work spread over its workers, (work[j] - work[k]) / workers[a] (`work` the prefix
    sums of m * compute, `workers[a]` those of w - w' units), which never increases with k, so rows before
    the first that can reach the current value of some column are cut. The bands, about a block wide, are
    gathered in one go: O(L^2 n^2 width) per level in practice instead of O(L^3 n^2). A block with a
    column still infinite (its one-stage plan over memory) cuts nothing: it is first seeded with the splits
    next to the balanced one, where the two bounds meet."""
    L1, width = best.shape[1], windows.shape[1]  # L + 1 rows; `windows`: best's every run of `width` values
    n_a, n_k = left.shape
    n_j = n_k  # columns j = i + 2 .. L, rows k = i + 1 .. L - 1
    nb = -(-n_j // width)
    out = np.full(nb * width, -INF)
    out[:n_j] = best[w, i, i + 2:L1]
    seg = out.reshape(nb, width)
    ends = np.minimum(n_j, np.arange(1, nb + 1) * width)  # rows t <= column c: non-empty rests only
    rows = work[i + 1:L1 - 1]
    if np.isinf(seg.max(axis=1)).any():
        total = workers[0] + workers[-1]  # w units' workers (workers[a] + those of a + 1 units, any a)
        first_j = work[i + 2 + np.arange(nb) * width]
        last_j = work[i + 1 + ends]
        # The split where w' and w - w' units get work in proportion: work[k] = (w'' work[i] + w' work[j]) / w.
        lo = np.maximum(np.searchsorted(rows, (workers[:, None] * work[i] + (total - workers[:, None])
                                               * first_j[None, :]) / total) - 1, 0)
        hi = np.minimum(np.searchsorted(rows, (workers[:, None] * work[i] + (total - workers[:, None])
                                               * last_j[None, :]) / total) + 1, ends[None, :])
        hi = np.where(np.isinf(seg.max(axis=1))[None, :], hi, 0)
        _gather_min(best, windows, w, i, left, lo, hi, seg)
    ub = seg.max(axis=1)
    wk = np.full(nb * width, work[-1])
    wk[:n_j] = work[i + 2:]
    slack = 1e-12 * abs(float(work[-1]))  # the prefix sums' rounding
    thr = (wk.reshape(1, nb, width) - seg[None] * (1 + 1e-9) * workers[:, None, None]).min(axis=2) - slack
    lo = np.searchsorted(rows, thr.ravel(), side="right").reshape(n_a, nb)
    hi = np.empty((n_a, nb), dtype=np.int64)
    for a in range(n_a):
        hi[a] = np.searchsorted(base[a], ub, side="left")
    _gather_min(best, windows, w, i, left, lo, np.minimum(hi, ends[None, :]), seg)
    best[w, i, i + 2:L1] = out[:n_j]


def _gather_min(best: np.ndarray, windows: np.ndarray, w: int, i: int, left: np.ndarray, lo: np.ndarray,
                hi: np.ndarray, seg: np.ndarray) -> None:
    """seg[b] = min(seg[b], max(left[a, t], best[w - 1 - a, i + 1 + t, block b's columns])) over a and the
    rows lo[a, b] <= t < hi[a, b], in place (_minmax's bands, gathered with one fancy index)."""
    (L1, row), width = best.shape[1:], windows.shape[1]  # L + 1 rows, L + 1 + width columns
    n_a, nb = lo.shape
    cnt = np.maximum(hi - lo, 0).T.ravel()  # segments ordered by block, then w'
    total = int(cnt.sum())
    if total == 0:
        return
    # Per segment (block b, w' = a + 1): where its first row starts in `best` and in `left`, less its offset in
    # the gathered list, so that each gathered row's index is that plus its position (few numpy calls a segment).
    shift = lo.T.ravel() - (np.cumsum(cnt) - cnt)
    a_of = np.arange(n_a * nb) % n_a
    in_best = ((w - 1 - a_of) * L1 + i + 1 + shift) * row + (i + 2) + np.repeat(np.arange(nb), n_a) * width
    in_left = a_of * left.shape[1] + shift
    sel = np.repeat(np.arange(len(cnt)), cnt)
    pos = np.arange(total)
    vals = windows[in_best[sel] + pos * row]  # rows of `width` columns, copied
    np.maximum(vals, left.reshape(-1)[in_left[sel] + pos][:, None], out=vals)
    per_block = cnt.reshape(nb, n_a).sum(axis=1)
    some = np.nonzero(per_block)[0]
    firsts = (np.cumsum(per_block) - per_block)[some]
    red = np.minimum.reduceat(vals, firsts, axis=0)
    np.minimum(seg[some], red, out=red)
    seg[some] = red


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
