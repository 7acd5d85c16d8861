"""The schedule IR: action kinds, actions (`F3`, `SEND_B3`, `STEP`, `1F3`) and per-worker action lists (pure).

A *worker* is one (stage, replica) pair; workers are numbered stage-major, so with replicas (2, 1, 1)
workers 0, 1 are stage 0 and worker 2 is stage 1. With `virtual_stages` v > 1 (interleaved schedules) the
model has S*v stages over S rank groups: a worker is (group, replica), model stage k runs on group k % S
(Megatron's round-robin chunks), and every action but STEP names its model stage (`1F3`); chunk k sends to
chunk k+1 on the next group, the last group wrapping to group 0. Replica r of stage s runs the microbatches i with
i % replicas[s] == r (PipeDream's 1F1B-RR), and sends microbatch i to replica i % replicas[s + 1] downstream.
Like torch pipelining's `_ComputationType` and `_Action(stage, kind, microbatch)`, with a string form that
round-trips.
"""
from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field


class Kind(str, enum.Enum):
    """What an action does; its value is its string form (a str, so `Kind.F == "F"`)."""

    F = "F"  # forward
    B = "B"  # backward (input and weight gradients; B alone once W is split off)
    W = "W"  # weight gradient, deferred (zero-bubble schedules)
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    STEP = "STEP"  # optimizer step (all-reduced over the stage's replicas)

    def __str__(self) -> str:  # enum.StrEnum's behaviour, on Python 3.10 too
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.W)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_F, Kind.RECV_B)

    @property
    def direction(self) -> Kind:
        """The compute kind a transfer serves: F for activations, B for gradients."""
        return Kind.F if self in (Kind.SEND_F, Kind.RECV_F) else Kind.B


COMPUTE = (Kind.F, Kind.B, Kind.W)
KINDS = tuple(k.value for k in Kind)
SEND = {Kind.F: Kind.SEND_F, Kind.B: Kind.SEND_B}
RECV = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B}

_ACTION_RE = re.compile(r"^(\d+)?(SEND_F|RECV_F|SEND_B|RECV_B|STEP|F|B|W)(\d+)?$")


class ScheduleError(ValueError):
    """A schedule that is malformed, inconsistent or deadlocks; the message holds its grid."""


@dataclass(frozen=True, order=True)
class Action:
    """`F3`, `SEND_B3`, `STEP`; with a (virtual) stage prefix: `1F3`. str() round-trips with parse()."""

    kind: Kind
    microbatch: int | None = None
    stage: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")
        object.__setattr__(self, "kind", Kind(self.kind))  # a str given: its Kind
        if (self.kind is Kind.STEP) != (self.microbatch is None):
            raise ValueError(f"{self.kind} {'takes no' if self.kind is Kind.STEP else 'needs a'} microbatch")

    def __str__(self) -> str:
        prefix = "" if self.stage is None else str(self.stage)
        suffix = "" if self.microbatch is None else str(self.microbatch)
        return f"{prefix}{self.kind}{suffix}"

    @classmethod
    def parse(cls, text: str) -> Action:
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. 'F3', 'SEND_B3', 'STEP', '1F3'")
        stage, kind, mb = m.groups()
        return cls(Kind(kind), None if mb is None else int(mb), None if stage is None else int(stage))

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute


def F(i: int) -> Action:
    return Action(Kind.F, i)


def B(i: int) -> Action:
    return Action(Kind.B, i)


STEP = Action(Kind.STEP)


@dataclass
class Schedule:
    """Per-worker action lists of one schedule over `stages` stages and `microbatches` microbatches."""

    name: str
    stages: int
    microbatches: int
    replicas: tuple[int, ...]
    actions: list[list[Action]] = field(default_factory=list)
    virtual_stages: int = 1  # v: model stages per rank group (chunks placed round-robin); S*v model stages

    def __post_init__(self) -> None:
        if len(self.replicas) != self.stages:
            raise ScheduleError(f"replicas {self.replicas} has {len(self.replicas)} entries, expected {self.stages}")
        if self.virtual_stages < 1:
            raise ScheduleError(f"virtual_stages must be >= 1, found {self.virtual_stages}")

    @property
    def model_stages(self) -> int:
        """Stages of the model: S*v (S when each group holds one stage)."""
        return self.stages * self.virtual_stages

    def chunks_of(self, worker: int) -> list[int]:
        """The model stages a worker holds: its group g, g+S, g+2S, ..."""
        return list(range(self.stage_of(worker), self.model_stages, self.stages))

    def stage_at(self, worker: int, action: Action) -> int:
        """The model stage an action runs on: the one it names, else (one stage per group) the worker's."""
        return self.stage_of(worker) if action.stage is None else action.stage

    @property
    def workers(self) -> list[tuple[int, int]]:
        return [(s, r) for s in range(self.stages) for r in range(self.replicas[s])]

    def worker(self, stage: int, replica: int) -> int:
        return sum(self.replicas[:stage]) + replica

    def stage_of(self, worker: int) -> int:
        return self.workers[worker][0]

    def microbatches_of(self, worker: int) -> list[int]:
        s, r = self.workers[worker]
        return [i for i in range(self.microbatches) if i % self.replicas[s] == r]

    def peer(self, worker: int, action: Action) -> int:
        """The worker on the other end of a SEND/RECV action."""
        s = self.stage_at(worker, action)
        assert action.microbatch is not None
        downstream = action.kind in (Kind.SEND_F, Kind.RECV_B)
        t = s + 1 if downstream else s - 1
        if not 0 <= t < self.model_stages:
            raise ScheduleError(f"{action} on stage {s} has no peer stage {t}\n{self.render()}")
        g = t % self.stages  # the group holding stage t (round-robin; t itself when v == 1)
        return self.worker(g, action.microbatch % self.replicas[g])

    def render(self, mark: dict[int, int] | None = None, labels: Sequence[str] | None = None) -> str:
        """Step x worker grid; `mark` maps worker -> step index flagged `<-- ERROR HERE`."""
        mark = mark or {}
        labels = list(labels or [f"s{s}r{r}" if self.replicas[s] > 1 else f"s{s}" for s, r in self.workers])
        cells = [[str(a) for a in acts] for acts in self.actions]
        for w, i in mark.items():
            if i < len(cells[w]):
                cells[w][i] = f"*{cells[w][i]}*"
        width = max([len(x) for x in labels] + [len(c) for col in cells for c in col] + [4])
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        rows = [f"{self.name} S={self.stages}{v} m={self.microbatches} replicas={list(self.replicas)}",
                "step  " + " ".join(x.ljust(width) for x in labels)]
        for step in range(max((len(c) for c in cells), default=0)):
            row = " ".join((col[step] if step < len(col) else "").ljust(width) for col in cells)
            flag = "  <-- ERROR HERE" if any(i == step for i in mark.values()) else ""
            rows.append(f"{step:<5} {row}".rstrip() + flag)
        return "\n".join(rows)
