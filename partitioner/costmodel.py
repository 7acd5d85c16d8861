"""The DP's cost model (PipeDream SOSP'19 §3.1, extended): per-stage lower bounds of the simulated step time; pure.

The DP computes, for every plan, a LOWER BOUND of its simulated step time (partitioner/simulate.py replays
the real schedule): the busiest worker's own work. The search (partitioner/search.py) then visits plans in
order of this bound and lets the simulator decide, so the plan chosen is the best one the simulator knows.

Bound (time per minibatch of m microbatches, ms). A stage [i, j) on r units of level k, linked at
bandwidth bw_k, with t = forward + backward (+ the loss on the last layer, + the runtime's own time per
forward and backward and per message it sends: LayerCosts.stage_overhead_ms, which the simulator's stage
costs use too) per microbatch, b its backward, P its parameter bytes (a shared parameter once: LayerCosts.ties),
q = ceil(m / r) the microbatches of its busiest replica (round-robin), costs

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
its stages; every worker is used. Schedule rules: `async` needs r | m, `2bw` r <= m, and neither
splits the layers sharing a parameter over stages (ScheduleKind.ties_allowed).

Memory is checked on level-0 stages: parameters * (1 + weight versions) + trainable parameters * (1 + optimizer
states) + buffers, plus the activations (and the unsaved part of the boundary tensors) of the microbatches in
flight, ceil(D / r) for 1F1B-like schedules (D = workers from this stage on, schedule.warmup_forwards + 1), all local
ones for gpipe; under CUDA graphs (LayerCosts.graphs) twice
the port's bytes too. In a group of a multi-level topology D is bounded by (workers left in the group) + (all
workers outside it): conservative."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from partitioner.layercosts import LayerCosts, PlanningError
from partitioner.topology import Topology
from pipeflow.kinds import SCHEDULES, InFlight, ScheduleKind, schedule_kind, zero_bubble_limit

OPTIMIZER_STATES = {"sgd": 1, "adam": 2, "adamw": 2}  # momentum; exp_avg + exp_avg_sq
INF = float("inf")


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
    C: np.ndarray = field(init=False, repr=False)  # prefix sums: compute, backward, forward, activations
    Bw: np.ndarray = field(init=False, repr=False)
    Fw: np.ndarray = field(init=False, repr=False)
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
        self.A = np.concatenate([zero, np.cumsum(lay.activation_bytes)])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bw(self, level: int) -> float:  # bytes per ms
        return self.topology.levels[level].bandwidth / 1e3

    def allreduce_ms(self, p: np.ndarray | float, r: np.ndarray | float, level: int) -> np.ndarray:
        """Ring all-reduce of p bytes over r units (Patarasuk & Yuan): 2 (r-1)/r * p / bw."""
        return 2.0 * (np.asarray(r) - 1) / r * p / self.bw(level)

    def share(self, r: np.ndarray | float) -> np.ndarray:  # the busiest of r replicas' microbatches (round-robin)
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
        p = self.layers.trainable(i, k)
        b = self.Bw[k] - self.Bw[i] + self.layers.stage_overhead_ms(i, k)[1]
        busy, last = np.asarray(unit_ms) * (self.share(r) / self.microbatches), np.asarray(k) == self.num_layers
        # beside the last backward, or under the whole next minibatch (2bw's deferred update, update.py)
        late = self.kind.reduce_waits_a_step(last, self.layers.shard_optimizer)
        exposed = np.maximum(0.0, self.allreduce_ms(p, r, level) - np.where(late, busy, b))
        if level == 0:  # a sharded update's exchange lands under the next forward (update_ms)
            exposed = exposed + self.update_ms(i, k, r, level, b)
        if self.kind.flush and level == len(self.topology.levels) - 1:
            out = self._flushed(busy, i, k, r, b, exposed)
        else:
            out = busy + self.steps(r, level) * exposed
        if self.kind.replicas_divide_m:  # async: the replicas all-reduce at every step: each runs as many
            out = np.where(self.microbatches % np.asarray(r) == 0, out, INF)
        if self.kind.replicas_at_most_m:  # 2bw: every replica owns a share of each minibatch
            out = np.where(np.asarray(r) <= self.microbatches, out, INF)
        if not self.kind.ties_allowed and len(self.layers.ties):  # async, 2bw: a shared parameter on one stage
            out = np.where(self.layers.ties.splits(i, k), INF, out)
        return out

    def update_ms(self, i: np.ndarray | int, k: np.ndarray | int, r: np.ndarray | float, level: int,
                  b: np.ndarray | float) -> np.ndarray:
        """One update of stage [i, k) (backward b a microbatch) on r units of `level`: the step over its p bytes, or
        sharded a 1/r share of it (at most as many as the topology's groups of this level hold) and what it waits of
        the exchange of the rest (ScheduleKind.exchange_exposed_ms; outer levels': the simulator), priced as an
        all-reduce, 2 (r - 1)/r p / bw: it moves half the bytes, at half the all-reduce's bandwidth (2 x H200)."""
        lay = self.layers
        p = lay.trainable(i, k)
        if not lay.shard_optimizer:
            return np.asarray(lay.optimizer_ms_per_byte * p + lay.update_ms)
        r = np.asarray(r, dtype=np.float64)
        most = r * (self.topology.workers // self.topology.unit_size(level + 1))
        fwd, first = self.stage_compute_ms(i, k) - b, lay.parameter_bytes[np.asarray(i)] / np.maximum(p, 1.0)
        sent = self.kind.exchange_exposed_ms(self.allreduce_ms(p, r, level), np.asarray(k) == self.num_layers, fwd,
                                             first, fwd - (self.Fw[np.asarray(k) - 1] - self.Fw[i]))
        return lay.optimizer_ms_per_byte * p / most + lay.update_ms + sent

    def _flushed(self, busy: np.ndarray, i: np.ndarray | int, k: np.ndarray | int, r: np.ndarray | float,
                 b: np.ndarray, exposed: np.ndarray) -> np.ndarray:
        """The flush makes latency count (gpipe, 1f1b; top level): a replica's first forward waits for
        microbatch 0 to cross the stages before it (forward of layers [0, i)), its first backward for the
        round trip through the stages after it (layers [k, L)), and after its last backward the gradient
        still crosses the stages before it (backward of [0, i)) while it all-reduces and steps."""
        L = self.num_layers
        fwd = self.stage_compute_ms(i, k) - b  # forward of [i, k), the loss included on the last layer
        # Level 0: the replica runs ceil(m / r) backwards; above, a unit's replicas are not known here.
        backwards = self.share(r) if len(self.topology.levels) == 1 else 1.0
        trip = fwd + (self.C[L] - self.C[k]) + backwards * b
        return self.Fw[i] + np.maximum(busy, trip) + np.maximum(self.Bw[i], exposed)

    def port_ms(self, i: np.ndarray | int, k: np.ndarray | int | None, r: np.ndarray | float,
                level: int) -> np.ndarray:  # the busiest replica's port busy: ceil(m / r) microbatches' bytes
        return self.share(r) * self.layers.port_bytes(i, k) / self.bw(level)

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
        """Weights and their stashed versions, gradients and optimizer state (of the trainable ones), buffers, in-flight
        activations with what the stage holds of its boundary tensors (LayerCosts.boundary_bytes); on the stage of the
        last layer, the loss's memory too, what its backward keeps once per microbatch in flight; under CUDA graphs
        LayerCosts.graph_bytes of the local microbatches."""
        lay, fl = self.layers, self.in_flight(downstream, r)
        p = lay.params(i, j)
        states = OPTIMIZER_STATES[self.optimizer] / (np.asarray(r) if lay.shard_optimizer else 1)
        share = 1 / np.asarray(r) if lay.shard_optimizer else 1.0  # a deferred update's held gradient
        return (p * (1 + self.kind.stashed_versions(fl, share)) + lay.trainable(i, j) * (1 + states)
                + lay.buffers(i, j) + lay.graph_bytes(i, j, self.share(r)) + fl * (self.A[j] - self.A[i]
                                                                                  + lay.boundary_bytes(i, j))
                + ((fl - 1) * lay.loss_saved_bytes + lay.loss_bytes) * (np.asarray(j) == self.num_layers))

    def outside(self, level: int) -> int:
        """Workers outside one level-`level` group that may sit downstream of it (bound for D)."""
        return self.topology.workers - self.topology.unit_size(level + 1)

    def stage_compute_ms(self, i: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
        """Forward + backward of [i, k) a microbatch: its layers, the loss, LayerCosts.stage_overhead_ms."""
        fwd, bwd = self.layers.stage_overhead_ms(i, k)
        return np.asarray(self.C[k] - self.C[i] + fwd + bwd)

    def unit_ms(self, level: int, i: int, j: np.ndarray, inner: np.ndarray | None) -> np.ndarray:
        if level == 0:
            return self.microbatches * self.stage_compute_ms(i, j)
        assert inner is not None
        return inner[i, j]

    def stage_rows(self, level: int, i: int, ks: np.ndarray, n: int, inner: np.ndarray | None) -> np.ndarray:
        """Stages [i, k) for k in ks on r = 1..n units, shape (n, len(ks)); --straight: inf; memory: `fit`."""
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
