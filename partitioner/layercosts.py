"""A profile's columns as the planner reads them (LayerCosts: per layer, and the runtime's own costs) and its ties
as arrays (Ties: the layers sharing parameters, partitioner/ties.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from partitioner.profile import MEMORY_NUMBERS, RUNTIME_NUMBERS, Profile
from pipeflow.kinds import schedule_kind


class PlanningError(ValueError):
    """No plan satisfies the inputs; the message says which constraint and by how much."""


@dataclass(frozen=True)
class Ties:
    """A profile's ties as arrays: `count[x, g]` how many of tie g's layers lie in [0, x), `size[g]` its bytes."""

    count: np.ndarray
    size: np.ndarray
    spans: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, ties: Sequence[dict[str, Any]] | None, num_layers: int) -> Ties:
        ties = ties or []
        count = np.zeros((num_layers + 1, len(ties)))
        for g, tie in enumerate(ties):
            mark = np.zeros(num_layers)
            mark[tie["layers"]] = 1.0
            count[1:, g] = np.cumsum(mark)
        return cls(count, np.asarray([float(t["bytes"]) for t in ties]), tuple(tuple(t["layers"]) for t in ties))

    def __len__(self) -> int:
        return len(self.size)

    def _inside(self, i: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
        """How many of each tie's layers [i, k) holds: shape (*broadcast(i, k), ties)."""
        return np.asarray(self.count[np.asarray(k)] - self.count[np.asarray(i)])

    def repeated_bytes(self, i: np.ndarray | int, k: np.ndarray | int) -> np.ndarray | float:
        """The bytes [i, k)'s parameter_bytes count more than once (broadcasting over i and k)."""
        if not len(self):
            return 0.0
        return np.asarray(np.maximum(self._inside(i, k) - 1.0, 0.0) @ self.size)

    def splits(self, i: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
        """Whether stage [i, k) holds some but not all of a tie's layers (broadcasting over i and k)."""
        if not len(self):
            return np.zeros(np.broadcast(np.asarray(i), np.asarray(k)).shape, dtype=bool)
        inside = self._inside(i, k)
        return np.asarray(np.any((inside > 0) & (inside < self.count[-1]), axis=-1))

    def across(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, ...], float, list[int]]]:
        """Every tie held by more than one of these stages: its layers, its bytes and those stages (their copies'
        gradients are summed at the STEP; the asynchronous schedules cannot run such a plan)."""
        out = []
        for span, size in zip(self.spans, self.size):
            stages = sorted({s for s, (a, b) in enumerate(ranges) for x in span if a <= x < b})
            if len(stages) > 1:
                out.append((span, float(size), stages))
        return out


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
    action_ms: float = 0.0  # the runtime's own time per forward and per backward of a stage (profile.action_ms)
    message_ms: float = 0.0  # the sender's time per message to a neighbouring stage (profile.message_ms)
    latency_ms: float = 0.0  # a message's delay beyond bytes / bandwidth (profile.latency_ms; simulator only)
    step_gap_ms: float = 0.0  # the runtime's time between two steps (profile.step_gap_ms; once per step)
    layer_ms: float = 0.0  # the runtime's own time per layer of a stage, per forward and backward (profile.layer_ms)
    update_ms: float = 0.0  # the runtime's own time per optimizer update beyond the profiled step (profile.update_ms)
    loss_bytes: float = 0.0  # the loss's memory beyond its input, on the last layer's stage (profile.loss_bytes)
    copy_ms_per_byte: float = 0.0  # one copy of the weights (a stashed version), per byte (profile.copy_ms_per_byte)
    contention: float = 1.0  # the layers beside busy ranks over alone (profile.contention; price.contention_scale)
    shard_optimizer: bool = False  # a replicated stage's optimizer state split over its replicas (pipeflow/shard.py)
    graphs: bool = False  # the ranks replay CUDA graphs (profile.timing "graphs"): graph_bytes
    ties: Ties = field(default_factory=lambda: Ties.of(None, 0))  # layers sharing parameters (partitioner/ties.py)
    # Per layer, where the profile has them (profile.MEMORY_NUMBERS; None: 0): parameters without gradient (within
    # parameter_bytes), buffers, and of its input and of its output what its backward does not keep.
    frozen_bytes: np.ndarray | None = None
    buffer_bytes: np.ndarray | None = None
    unsaved: tuple[np.ndarray, np.ndarray] | None = None
    loss_saved_bytes: float = 0.0  # of loss_bytes, what its backward keeps: per microbatch in flight (LayerCosts.of
    # fills the fields above positionally: new ones go last)

    @classmethod
    def of(cls, forward_ms: Sequence[float], backward_ms: Sequence[float], output_bytes: Sequence[float],
           activation_bytes: Sequence[float], parameter_bytes: Sequence[float], *, loss_ms: float = 0.0,
           optimizer_ms_per_byte: float = 0.0, backward_weight_ms: Sequence[float] | None = None,
           action_ms: float = 0.0, message_ms: float = 0.0, latency_ms: float = 0.0,
           step_gap_ms: float = 0.0, layer_ms: float = 0.0, update_ms: float = 0.0,
           loss_bytes: float = 0.0, copy_ms_per_byte: float = 0.0, contention: float = 1.0) -> LayerCosts:
        cols = [np.asarray(c, dtype=np.float64) for c in
                (forward_ms, backward_ms, output_bytes, activation_bytes, parameter_bytes)]
        if len({len(c) for c in cols}) != 1 or len(cols[0]) == 0:
            raise PlanningError(f"layer cost columns must be non-empty and of equal length, found "
                                f"{[len(c) for c in cols]}")
        weight = None if backward_weight_ms is None else np.minimum(np.asarray(backward_weight_ms, np.float64), cols[1])
        return cls(cols[0], cols[1], cols[2], cols[3], cols[4], float(loss_ms), float(optimizer_ms_per_byte), weight,
                   float(action_ms), float(message_ms), float(latency_ms), float(step_gap_ms), float(layer_ms),
                   float(update_ms), float(loss_bytes), float(copy_ms_per_byte), max(1.0, float(contention)))

    def __len__(self) -> int:
        return len(self.forward_ms)

    @cached_property
    def _held(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Prefix sums of parameter_bytes, frozen_bytes and buffer_bytes."""
        return tuple(np.concatenate([[0.0], np.cumsum(c if c is not None else np.zeros(len(self)))])
                     for c in (self.parameter_bytes, self.frozen_bytes, self.buffer_bytes))  # type: ignore[return-value]

    def _sum(self, column: int, i: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
        return np.asarray(self._held[column][np.asarray(k)] - self._held[column][np.asarray(i)])

    def params(self, i: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
        """The parameter bytes stage [i, k) holds, each shared one once (ties) (broadcasting over i and k)."""
        return np.asarray(self._sum(0, i, k) - self.ties.repeated_bytes(i, k))

    def trainable(self, i: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
        """What of params(i, k) takes a gradient, optimizer state, an all-reduce and an update (not frozen)."""
        return np.maximum(0.0, self.params(i, k) - self.frozen(i, k))

    def frozen(self, i: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
        """Bytes of [i, k)'s parameters that take no gradient and no optimizer state (the weights themselves only)."""
        return self._sum(1, i, k)

    def buffers(self, i: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
        """Bytes of [i, k)'s buffers, held once."""
        return self._sum(2, i, k)

    def boundary_bytes(self, i: np.ndarray | int, k: np.ndarray | int) -> np.ndarray | float:
        """Per microbatch in flight, what stage [i, k) holds of its received input (i > 0) and its sent output (k < L)
        until the microbatch's backward (pipeflow/stage.py) beyond what its first and last layers' backward keep."""
        if self.unsaved is None:
            return 0.0
        i, k = np.asarray(i), np.asarray(k)
        return np.asarray(self.unsaved[0][i] * (i > 0) + self.unsaved[1][k - 1] * (k < len(self)))

    def stage_overhead_ms(self, i: np.ndarray | int, k: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """What the runtime adds to a forward and a backward of [i, k) beyond its layers (the DP's bound and the
        simulator's stage costs both use it): `action_ms` on each, `layer_ms` per layer, the sender's `message_ms`
        on the forward when a stage follows (k < L) and on the backward when one precedes (i > 0)."""
        n = len(self)
        own = self.action_ms + (self.layer_ms * (np.asarray(k) - np.asarray(i)) if self.layer_ms else 0.0)
        fwd = own + self.message_ms * (np.asarray(k) < n)
        bwd = own + self.message_ms * (np.asarray(i) > 0)
        return np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64)

    def port_bytes(self, i: np.ndarray | int, k: np.ndarray | int | None) -> np.ndarray:
        """A microbatch's bytes through stage [i, k)'s send (or receive) port: the activation in and its gradient
        out, the activation out where a stage follows (k < L; None: not known) and its gradient in."""
        nbytes = self.output_bytes[np.asarray(i) - 1] * (np.asarray(i) > 0)
        if k is not None:
            nbytes = nbytes + self.output_bytes[np.asarray(k) - 1] * (np.asarray(k) < len(self))
        return np.asarray(nbytes)

    def graph_bytes(self, i: np.ndarray | int, k: np.ndarray | int, local: np.ndarray | float) -> np.ndarray | float:
        """Under CUDA graphs (graphs.py) the static inputs and outputs of [i, k)'s actions for `local` microbatches."""
        return 2 * np.asarray(local) * self.port_bytes(i, k) if self.graphs else 0.0


def layer_costs(profile: Profile, schedule: str, optimizer: str) -> LayerCosts:
    """The profile's columns for this schedule: flush schedules and 2bw accumulate gradients over the
    microbatches of a step (backward_accumulate_ms where profiled), async steps after every backward; the
    layers' and the loss's times scaled by the calibrated compute_factor (1 when absent)."""
    f = profile.compute_factor or 1.0
    backward = profile.backward_column(accumulate=not schedule_kind(schedule).step_per_backward)
    lay = LayerCosts.of([f * x for x in profile.column("forward_ms")], [f * x for x in backward],
                        profile.column("output_bytes"), profile.column("activation_bytes"),
                        profile.column("parameter_bytes"), loss_ms=f * (profile.loss_ms or 0.0),
                        optimizer_ms_per_byte=profile.optimizer_ms_per_byte.get(optimizer, 0.0),
                        backward_weight_ms=[f * x for x in profile.weight_column()],
                        **{k: getattr(profile, k) or 0.0 for k in RUNTIME_NUMBERS},  # calibrated, else 0
                        loss_bytes=profile.loss_bytes or 0.0, copy_ms_per_byte=profile.copy_ms_per_byte or 0.0,
                        contention=profile.contention or 1.0)
    # the ranks replay CUDA graphs (pipeflow/graphs.py); the layers sharing parameters (partitioner/ties.py)
    mem = {k: np.asarray(profile.column(k)) if all(getattr(x, k) is not None for x in profile.layers) else None
           for k in MEMORY_NUMBERS}
    out = np.asarray(profile.column("output_bytes"))
    unsaved = None if mem["saved_input_bytes"] is None or mem["saved_output_bytes"] is None else (
        np.maximum(0.0, np.concatenate([[0.0], out[:-1]]) - mem["saved_input_bytes"]),
        np.maximum(0.0, out - mem["saved_output_bytes"]))
    return replace(lay, graphs=profile.timing == "graphs", ties=Ties.of(profile.ties, len(profile.layers)),
                   loss_saved_bytes=min(profile.loss_saved_bytes or 0.0, lay.loss_bytes),
                   frozen_bytes=mem["frozen_bytes"], buffer_bytes=mem["buffer_bytes"], unsaved=unsaved)
