"""Best-first search over plans: the DP's bound orders them, the simulator's replay of the schedule prices them.

The DP (planner.py) gives every plan a lower bound of its simulated step time and, for every suffix of
layers on w top-level units, the least bound any completion can reach. The search expands top-level stage
lists in order of bound (A*: bound of the stages so far, maximised with the suffix table), simulates each
complete plan the schedule allows, and stops when the next bound is no better than the best simulated
time: then no unvisited plan can be faster. On a one-level topology the bound holds for every plan, so the
plan chosen is the fastest the simulator knows; on more levels only top-level stage lists are searched
(each stage runs its group's DP optimum). `limit` caps the simulations and `expansions` the partial plans
expanded (each costs a row of the DP, ~1 ms at 512 layers): past either the search stops at the best so
far and says so (SearchResult.exact).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from partitioner.planner import INF, PlanningError, Solution, Tables

Stages = tuple[tuple[int, int, int], ...]


@dataclass
class SearchResult:
    solution: Solution
    step_ms: float  # the simulated time of the plan chosen
    simulated: int  # plans simulated
    exact: bool  # True when every plan that could beat it was bounded out


def search(tables: Tables, price: Callable[[Solution], float | None], *, limit: int = 64,
           expansions: int = 256, work: Callable[[Solution], float] | None = None, budget: float = INF,
           frontier: int = 200_000) -> SearchResult:
    """The plan of least `price` (simulated ms; None: the schedule does not allow the plan). The DP's own
    optimum is priced first, so there is always an answer when it is allowed. `work(plan)` estimates a
    simulation's cost: the search stops once `budget` of it is spent; `frontier` caps the open list."""
    model, top, best, inner = tables.model, tables.top, tables.best, tables.inner
    L, n = model.num_layers, model.topology.levels[top].workers
    tie = itertools.count()
    heap: list[tuple[float, int, Stages, float, int, int]] = [(float(best[n, 0]), 0, (), 0.0, 0, n)]
    incumbent, chosen, simulated, expanded, exact, spent = INF, None, 0, 0, True, 0.0
    first = tables.solution(tables.trace())
    t = price(first)
    simulated += 1
    spent += work(first) if work else 0.0
    seen = tuple((a, b, u) for a, b, u, _ in first.tree.stages)  # priced already
    if t is not None:
        incumbent, chosen = t, first
    while heap:
        bound, _, stages, prefix, i, w = heapq.heappop(heap)
        if bound >= incumbent or not np.isfinite(bound):
            break
        if w == 0:  # a complete plan: its bound is exact under the DP, its price the simulator's
            if stages == seen:
                continue
            sol = tables.solution(list(stages))
            t = price(sol)
            simulated += 1
            spent += work(sol) if work else 0.0
            if t is not None and t < incumbent:
                incumbent, chosen = t, sol
            if (simulated >= limit or spent >= budget) and heap and heap[0][0] < incumbent:
                exact = False
                break
            continue
        expanded += 1
        if expanded > expansions:
            exact = False
            break
        ks = np.arange(i + 1, L + 1)
        last = max(prefix, float(model.stage_row(top, i, ks[-1:], w, inner)[w - 1, 0]))
        if last < incumbent:
            heapq.heappush(heap, (last, next(tie), (*stages, (i, L, w)), last, L, 0))
        if w > 1 and i + 1 < L:
            left = np.maximum(model.split_row(top, i, ks[:-1], w, inner)[: w - 1], prefix)
            lb = np.maximum(left, best[w - 1:0:-1, i + 1:L])  # [w1 - 1, k - i - 1]
            for a, c in zip(*np.nonzero(lb < incumbent)):
                k, w1 = i + 1 + int(c), int(a) + 1
                heapq.heappush(heap, (float(lb[a, c]), next(tie), (*stages, (i, k, w1)), float(left[a, c]), k,
                                      w - w1))
        if len(heap) > frontier:
            exact = False
            break
    if chosen is None:
        raise PlanningError("no plan")  # the caller explains
    return SearchResult(chosen, incumbent, simulated, exact)
