"""PipeDream's partitioning DP (SOSP'19 §3.1), hierarchical and vectorized with numpy; pure (no torch).

The DP computes, for every plan, a LOWER BOUND of its simulated step time (partitioner/simulate.py replays
the real schedule): the busiest worker's own work. The search (partitioner/search.py) then visits plans in
order of this bound and lets the simulator decide, so the plan chosen is the best one the simulator knows.

Bound (time per minibatch of m microbatches, ms). A stage [i, j) on r units of level k, linked at
bandwidth bw_k, with t = forward + backward (+ the loss on the last layer) per microbatch, b its backward,
P its parameter bytes, q = ceil(m / r) the microbatches of its busiest replica (round-robin), costs

    busy  = U(i, j) * q / m + steps * (max(0, AR(P, r, bw_k) - b) + opt * P)
    port  = q * (in_bytes + out_bytes) / bw_k
    stage = max(busy, port)                          (async, 2bw, inner levels)
    stage = max(F(0, i) + max(busy', f + T(j, L) + q' b) + max(B(0, i), exposed), port)   (gpipe, 1f1b, top)
    AR(P, r, bw) = 2 (r-1)/r * P / bw                                                     (ring all-reduce)

U = m * t at level 0 and, at level k > 0, the best bound of [i, j) on one whole group of level k-1
(PipeDream's hierarchical optimizer: the group is a black box, replicated r times). The all-reduce is
bucketed into the last backward (pipeflow/reduce.py), so only its excess over b shows; `steps` is 1 per
minibatch, q for `async` (a step per microbatch; above level 0 that of a leaf with as many replicas as
the unit has workers, a lower bound) and the optimizer step `opt * P` follows each (opt from the
profile, 0 when absent; at level 0, inner levels carry it in U). Ports are full duplex: a replica's send
port carries its activations downstream and its input gradients upstream, q of each, and its receive
port the same the other way; in_bytes is the output of layer i-1 (none for the first stage), out_bytes
that of layer j-1 when a stage follows at this level. Under a flush (top level) latency counts: the
replica's first forward waits for the forwards of layers [0, i) (F), its first backward for the round
trip through layers [j, L) (T, f the stage's forward), and after its last backward the gradient still
crosses the backwards of [0, i) (B) while the stage all-reduces and steps (busy' and exposed: busy
without, and with, the step's part; q' = q on one level, 1 above). A plan's bound is the maximum over
its stages; every worker is used. Schedule rules: `async` needs r | m, `2bw` r <= m.

Memory is checked on level-0 stages: parameters * (2 + optimizer states + weight versions) plus the
activations of the microbatches in flight, ceil(D / r) for 1F1B-like schedules (D = workers from this
stage on, schedule.warmup_forwards + 1), all local ones for gpipe. Inside a group of a multi-level
topology D is bounded by (workers left in the group) + (all workers outside it): conservative.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from partitioner.topology import Topology
from pipeflow.kinds import SCHEDULES, InFlight, ScheduleKind, schedule_kind, zero_bubble_limit

OPTIMIZER_STATES = {"sgd": 1, "adam": 2, "adamw": 2}  # momentum; exp_avg + exp_avg_sq
INF = float("inf")
_CHUNK = 1 << 16  # elements per temporary array in the vectorized DP


class PlanningError(ValueError):
    """No plan satisfies the inputs; the message says which constraint and by how much."""


@dataclass
class LayerCosts:
    """Per-layer columns of a profile (ms per microbatch, bytes)."""

    forward_ms: np.ndarray
    backward_ms: np.ndarray  # with gradient accumulation where the profile measured it
    output_bytes: np.ndarray
    activation_bytes: np.ndarray
    parameter_bytes: np.ndarray
    loss_ms: float = 0.0  # forward + backward of the loss per microbatch, on the last layer's stage
    optimizer_ms_per_byte: float = 0.0  # one optimizer step, per parameter byte
    backward_weight_ms: np.ndarray | None = None  # the W share of backward_ms (zero-bubble schedules)

    @classmethod
    def of(cls, forward_ms: Sequence[float], backward_ms: Sequence[float], output_bytes: Sequence[float],
           activation_bytes: Sequence[float], parameter_bytes: Sequence[float], *, loss_ms: float = 0.0,
           optimizer_ms_per_byte: float = 0.0, backward_weight_ms: Sequence[float] | None = None) -> LayerCosts:
        cols = [np.asarray(c, dtype=np.float64) for c in
                (forward_ms, backward_ms, output_bytes, activation_bytes, parameter_bytes)]
        if len({len(c) for c in cols}) != 1 or len(cols[0]) == 0:
            raise PlanningError(f"layer cost columns must be non-empty and of equal length, found "
                                f"{[len(c) for c in cols]}")
        weight = None if backward_weight_ms is None else np.minimum(np.asarray(backward_weight_ms, np.float64), cols[1])
        return cls(cols[0], cols[1], cols[2], cols[3], cols[4], float(loss_ms), float(optimizer_ms_per_byte), weight)

    def __len__(self) -> int:
        return len(self.forward_ms)


@dataclass
class CostModel:
    """The inputs of the DP and its cost functions (broadcasting over numpy arrays)."""

    layers: LayerCosts
    topology: Topology
    schedule: str = "1f1b"
    microbatches: int = 1
    optimizer: str = "adam"
    memory_per_worker: float | None = None
    straight: bool = False
    C: np.ndarray = field(init=False, repr=False)  # prefix sums: compute, backward, parameters, activations
    Bw: np.ndarray = field(init=False, repr=False)
    Fw: np.ndarray = field(init=False, repr=False)
    P: np.ndarray = field(init=False, repr=False)
    A: np.ndarray = field(init=False, repr=False)
    kind: ScheduleKind = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise PlanningError(f"--schedule must be one of {', '.join(SCHEDULES)}, found {self.schedule!r}")
        self.kind = schedule_kind(self.schedule)
        if self.optimizer not in OPTIMIZER_STATES:
            raise PlanningError(f"--optimizer must be one of {', '.join(OPTIMIZER_STATES)}, "
                                f"found {self.optimizer!r}")
        if self.microbatches < 1:
            raise PlanningError(f"--microbatches must be >= 1, found {self.microbatches}")
        zero = np.zeros(1)
        lay = self.layers
        t = lay.forward_ms + lay.backward_ms
        t[-1] += lay.loss_ms
        self.C = np.concatenate([zero, np.cumsum(t)])
        self.Bw = np.concatenate([zero, np.cumsum(lay.backward_ms)])
        self.Fw = np.concatenate([zero, np.cumsum(lay.forward_ms)])
        self.P = np.concatenate([zero, np.cumsum(lay.parameter_bytes)])
        self.A = np.concatenate([zero, np.cumsum(lay.activation_bytes)])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bw(self, level: int) -> float:
        """Bandwidth of a level in bytes per ms."""
        return self.topology.levels[level].bandwidth / 1e3

    def allreduce_ms(self, p: np.ndarray | float, r: np.ndarray | float, level: int) -> np.ndarray:
        """Ring all-reduce of p bytes over r units (Patarasuk & Yuan): 2 (r-1)/r * p / bw."""
        return 2.0 * (np.asarray(r) - 1) / r * p / self.bw(level)

    def share(self, r: np.ndarray | float) -> np.ndarray:
        """Microbatches of the busiest of r replicas (round-robin: ceil(m / r))."""
        return np.ceil(self.microbatches / np.asarray(r, dtype=np.float64))

    def steps(self, r: np.ndarray | float, level: int = 0) -> np.ndarray | float:
        """Optimizer steps per minibatch of one replica: one, or one per own microbatch for async. Above
        level 0 a unit may hold up to unit_size replicas of a leaf stage, each stepping on its own share."""
        if not self.kind.step_per_backward:
            return 1.0
        return self.share(np.asarray(r, dtype=np.float64) * self.topology.unit_size(level))

    def stage_ms(self, unit_ms: np.ndarray | float, i: np.ndarray | int, k: np.ndarray | int,
                 r: np.ndarray | float, level: int) -> np.ndarray:
        """Compute bound of stage [i, k) on r units: U ceil(m / r) / m (PipeDream 1F1B-RR: r replicas share
        the m microbatches round-robin) plus, per step, the all-reduce beyond the last backward and the
        optimizer step."""
        p = self.P[k] - self.P[i]
        b = self.Bw[k] - self.Bw[i]
        exposed = np.maximum(0.0, self.allreduce_ms(p, r, level) - b)
        if level == 0:
            exposed = exposed + self.layers.optimizer_ms_per_byte * p
        busy = np.asarray(unit_ms) * (self.share(r) / self.microbatches)
        if self.kind.flush and level == len(self.topology.levels) - 1:
            out = self._flushed(busy, i, k, r, b, exposed)
        else:
            out = busy + self.steps(r, level) * exposed
        if self.kind.replicas_divide_m:  # async: the replicas all-reduce at every step: each runs as many
            out = np.where(self.microbatches % np.asarray(r) == 0, out, INF)
        if self.kind.replicas_at_most_m:  # 2bw: every replica owns a share of each minibatch
            out = np.where(np.asarray(r) <= self.microbatches, out, INF)
        return out

    def _flushed(self, busy: np.ndarray, i: np.ndarray | int, k: np.ndarray | int, r: np.ndarray | float,
                 b: np.ndarray, exposed: np.ndarray) -> np.ndarray:
        """The flush makes latency count (gpipe, 1f1b; top level): a replica's first forward waits for
        microbatch 0 to cross the stages before it (forward of layers [0, i)), its first backward for the
        round trip through the stages after it (layers [k, L)), and after its last backward the gradient
        still crosses the stages before it (backward of [0, i)) while it all-reduces and steps."""
        L = self.num_layers
        fwd = (self.C[k] - self.C[i]) - b  # forward of [i, k), the loss included on the last layer
        # Level 0: the replica runs ceil(m / r) backwards; above, a unit's replicas are not known here.
        backwards = self.share(r) if len(self.topology.levels) == 1 else 1.0
        trip = fwd + (self.C[L] - self.C[k]) + backwards * b
        return self.Fw[i] + np.maximum(busy, trip) + np.maximum(self.Bw[i], exposed)

    def port_ms(self, i: np.ndarray | int, k: np.ndarray | int | None, r: np.ndarray | float,
                level: int) -> np.ndarray:
        """Busy time of the busiest replica's send (or receive) port: ceil(m / r) messages in, as many out."""
        out = self.layers.output_bytes
        nbytes = out[np.asarray(i) - 1] * (np.asarray(i) > 0)
        if k is not None:
            nbytes = nbytes + out[np.asarray(k) - 1]
        return self.share(r) * nbytes / self.bw(level)

    def in_flight(self, downstream: np.ndarray | int, r: np.ndarray | int) -> np.ndarray:
        """Microbatches whose activations a replica keeps (schedule.warmup_forwards + 1, or all for gpipe)."""
        r = np.asarray(r)
        local = -(-self.microbatches // r)
        if self.kind.in_flight is InFlight.ALL:
            return local
        fill = -(-np.asarray(downstream) // r)
        if self.kind.in_flight in (InFlight.PIPELINE, InFlight.TWICE_PIPELINE):  # zero bubble: an upper bound
            return np.minimum(zero_bubble_limit(self.kind.in_flight, self.topology.workers, r), local)
        return np.minimum(fill, local) if self.kind.in_flight is InFlight.FILL_UP_TO_ALL else fill

    def memory_bytes(self, i: np.ndarray | int, j: np.ndarray | int, r: np.ndarray | int,
                     downstream: np.ndarray | int) -> np.ndarray:
        """Weights, gradients, optimizer state, stashed weight versions and in-flight activations."""
        p = self.P[j] - self.P[i]
        fl = self.in_flight(downstream, r)
        return (p * (2 + OPTIMIZER_STATES[self.optimizer] + self.kind.stashed_versions(fl))
                + fl * (self.A[j] - self.A[i]))

    def outside(self, level: int) -> int:
        """Workers outside one level-`level` group that may sit downstream of it (bound for D)."""
        return self.topology.workers - self.topology.unit_size(level + 1)

    def unit_ms(self, level: int, i: int, j: np.ndarray, inner: np.ndarray | None) -> np.ndarray:
        if level == 0:
            return self.microbatches * (self.C[j] - self.C[i])
        assert inner is not None
        return inner[i, j]

    def stage_rows(self, level: int, i: int, ks: np.ndarray, n: int, inner: np.ndarray | None) -> np.ndarray:
        """Cost of stages [i, k) for k in ks on r = 1..n units, inf where --straight forbids replicas;
        shape (n, len(ks)). Memory is applied per range size by `fit`."""
        rs = np.arange(1, n + 1, dtype=np.float64)[:, None]
        out = self.stage_ms(self.unit_ms(level, i, ks, inner)[None, :], i, ks[None, :], rs, level)
        if i > 0:
            out = np.maximum(out, self.port_ms(i, None, rs, level))
        if self.straight:
            out[1:] = INF
        return out

    def fit(self, level: int, i: int, ks: np.ndarray, w: int, rows: np.ndarray) -> np.ndarray:
        """rows[:w] with inf where a level-0 stage [i, k) on r units, w units from it on, exceeds memory."""
        out = rows[:w]
        if level == 0 and self.memory_per_worker is not None:
            d = w + (0 if len(self.topology.levels) == 1 else self.outside(0))
            mem = self.memory_bytes(i, ks[None, :], np.arange(1, w + 1)[:, None], d)
            out = np.where(mem > self.memory_per_worker, INF, out)
        return out

    def stage_row(self, level: int, i: int, ks: np.ndarray, w: int, inner: np.ndarray | None) -> np.ndarray:
        """Stages [i, k) on r = 1..w units when the range has w units from i on. Shape (w, len(ks))."""
        return self.fit(level, i, ks, w, self.stage_rows(level, i, ks, w, inner))

    def split_row(self, level: int, i: int, ks: np.ndarray, w: int, inner: np.ndarray | None) -> np.ndarray:
        """As stage_row for a stage that is followed by another at this level: adds its output boundary."""
        rs = np.arange(1, w + 1, dtype=np.float64)[:, None]
        return np.maximum(self.stage_row(level, i, ks, w, inner), self.port_ms(i, ks[None, :], rs, level))


@dataclass
class Node:
    """A plan of layers on one group of `level`: stages (start, end, units, child plan on one unit)."""

    level: int
    stages: list[tuple[int, int, int, Node | None]]


@dataclass
class LeafStage:
    """A stage of the flattened plan: layers [start, end), its ranks, its replica factor per level, and the
    level its input boundary crosses (None for the first stage)."""

    start: int
    end: int
    ranks: list[int]
    factors: list[int]
    in_level: int | None


@dataclass
class Solution:
    objective_ms: float
    tree: Node
    stages: list[LeafStage]


def evaluate(model: CostModel, node: Node) -> float:
    """The cost-model time of a plan tree, computed directly (the DP must agree with it)."""
    levels = model.topology.levels
    outside = 0 if len(levels) == 1 else model.outside(0)
    total = sum(u for _, _, u, _ in node.stages)
    worst, left = 0.0, total
    for t, (a, b, u, child) in enumerate(node.stages):
        if child is None:
            unit = model.microbatches * (model.C[b] - model.C[a])
        else:
            unit = evaluate(model, child)
        cost = float(model.stage_ms(unit, a, b, u, node.level))
        cost = max(cost, float(model.port_ms(a, b if t < len(node.stages) - 1 else None, u, node.level)))
        if model.straight and u > 1:
            cost = INF
        if node.level == 0 and model.memory_per_worker is not None:
            if float(model.memory_bytes(a, b, u, left + outside)) > model.memory_per_worker:
                cost = INF
        worst = max(worst, cost)
        left -= u
    return worst


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
        best = np.full((n + 1, L + 1, L + 1), INF)
        rs = np.arange(1, n + 1, dtype=np.float64)[:, None]
        for i in range(L - 1, -1, -1):
            ks = np.arange(i + 1, L + 1)
            rows = model.stage_rows(level, i, ks, n, inner)
            bounds = model.port_ms(i, ks[None, :-1], rs, level)
            for w in range(1, n + 1):
                stage = model.fit(level, i, ks, w, rows)
                best[w, i, i + 1:] = stage[w - 1]  # one stage on all w units
                if w > 1 and i + 1 < L:
                    # First stage [i, k) on w' units, the rest [k, j) on w - w', for k in (i, L), j in (i + 1, L].
                    left = np.maximum(stage[: w - 1, :-1], bounds[: w - 1])
                    rest = best[w - 1:0:-1, i + 1:L, i + 2:]
                    row = best[w, i, i + 2:]
                    # A lower bound of the first stage's cost that never decreases with k (suffix min).
                    bound = np.minimum.accumulate(stage[: w - 1, :-1].min(axis=0)[::-1])[::-1]
                    _minmax(left, bound, rest, row)
            if progress is not None:
                progress.tick(level, L - i, L)
        self.best = best

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


def _minmax(left: np.ndarray, base: np.ndarray, rest: np.ndarray, out: np.ndarray) -> None:
    """out[j] = min(out[j], min over (w', k) of max(left[w', k], rest[w', k, j])), in place.

    Row k is the split after layer i + k + 1 and column j the range end i + j + 2, so rows k > j are
    empty ranges (inf) and are skipped block by block. `base` bounds left from below and never decreases
    with k, so once base >= out[j] no later row can improve column j."""
    n_j = rest.shape[2]
    width = 64
    for c0 in range(0, n_j, width):
        c1 = min(n_j, c0 + width)
        ub = out[c0:c1].max()
        k1 = min(c1, int(np.searchsorted(base, ub, side="left")))
        if k1 <= 0:
            continue
        block = np.maximum(rest[:, :k1, c0:c1], left[:, :k1, None])
        np.minimum(out[c0:c1], block.min(axis=(0, 1)), out=out[c0:c1])


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


def flatten(tree: Node, topology: Topology) -> list[LeafStage]:
    """Leaf stages in layer order with their ranks: a node's stages take consecutive units of each group
    it is replicated on, so replicas and neighbours share the fastest level the plan allows."""
    leaves: list[LeafStage] = []
    k = len(topology.levels)

    def walk(node: Node, bases: list[int], factors: list[int], in_level: int | None) -> None:
        size = topology.unit_size(node.level)
        offset = 0
        for t, (a, b, u, child) in enumerate(node.stages):
            units = [base + (offset + x) * size for base in bases for x in range(u)]
            f = factors.copy()
            f[node.level] = u
            lvl = in_level if t == 0 else node.level
            if child is None:
                leaves.append(LeafStage(a, b, units, f, lvl))
            else:
                walk(child, units, f, lvl)
            offset += u

    walk(tree, [0], [1] * k, None)
    return leaves
