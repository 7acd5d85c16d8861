"""plan.json (`pipeflow.plan/1`): Plan dataclasses, load/save/validate (docs/formats.md).

Under a schedule that places chunks round-robin (`interleaved`), a plan lists S*v stages over S rank groups:
stage k has the ranks of stage k mod S, which is how a reader tells S (the first stage repeating stage 0's
ranks) and v."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from partitioner.jsonfile import check_fields, read_json, show_repr, write_json
from pipeflow.kinds import WARMUP_SCHEDULES
from pipeflow.schedule import SCHEDULES, schedule_kind

PLAN_FORMAT = "pipeflow.plan/1"
ACCUMULATIONS = ("autograd", "gemm")  # how stages accumulate gradients (pipeflow/split.py, PIPEFLOW_GRAD_ACCUM)


class PlanError(ValueError):
    """A plan.json that is malformed or does not fit the model / world; the message names the field."""


@dataclass
class StagePlan:
    layers: tuple[int, int]  # half-open [start, end) over profile layer indices
    replicas: int
    ranks: list[int]

    def __post_init__(self) -> None:
        self.layers = (int(self.layers[0]), int(self.layers[1]))
        if self.layers[0] >= self.layers[1]:
            raise PlanError(f"stage layers {show_repr(list(self.layers))} are empty: expected [start, end) with "
                            "start < end")
        if self.replicas != len(self.ranks):
            raise PlanError(f"stage with layers {show_repr(list(self.layers))} has replicas={show_repr(self.replicas)} "
                            f"but {len(self.ranks)} ranks {show_repr(self.ranks)}")


@dataclass
class Plan:
    schedule: str
    microbatches: int
    workers: int
    stages: list[StagePlan]
    predicted: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # anything else the planner records

    def __post_init__(self) -> None:
        self.validate()

    @property
    def groups(self) -> int:
        """Rank groups S: the stages before the first that repeats stage 0's ranks (all, when none does)."""
        return next((k for k in range(1, len(self.stages)) if self.stages[k].ranks == self.stages[0].ranks),
                    len(self.stages))

    @property
    def virtual_stages(self) -> int:
        """Stages per rank group v (chunks placed round-robin); 1 for a plan where every rank appears once."""
        return len(self.stages) // self.groups if self.stages else 1

    @property
    def replicas(self) -> list[int]:
        """Replica count of each rank group (of each stage, when every rank holds one stage)."""
        return [s.replicas for s in self.stages[:self.groups]]

    @property
    def warmup(self) -> list[int] | None:
        """1f1b's forwards before the first backward per stage, as the planner chose them (optional field
        `warmup`); None: the schedule's minimum."""
        w = self.extra.get("warmup")
        return list(w) if w is not None else None

    @property
    def accumulation(self) -> str | None:
        """How the plan was priced to accumulate gradients (optional field `accumulation`: "autograd" or "gemm",
        pipeflow/split.py); pipeflow-train runs it unless PIPEFLOW_GRAD_ACCUM says otherwise. None: autograd."""
        return self.extra.get("accumulation")

    @property
    def shard_optimizer(self) -> bool:
        """Replicated stages split their optimizer state over their replicas (optional field `shard_optimizer`,
        pipeflow/shard.py): priced so by pipeflow-plan --shard-optimizer, run so by pipeflow-train."""
        return bool(self.extra.get("shard_optimizer", False))

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1] if self.stages else 0

    def stage_of_rank(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of a rank."""
        for s, st in enumerate(self.stages):
            if rank in st.ranks:
                return s, st.ranks.index(rank)
        raise PlanError(f"rank {rank} is in no stage of the plan (workers={self.workers})")

    def validate(self, *, num_layers: int | None = None, world_size: int | None = None) -> None:
        if self.schedule not in SCHEDULES:
            raise PlanError(f"plan.schedule must be one of {', '.join(SCHEDULES)}, found {show_repr(self.schedule)}")
        if self.microbatches < 1:
            raise PlanError(f"plan.microbatches must be >= 1, found {self.microbatches}")
        if not self.stages:
            raise PlanError("plan.stages is empty: expected at least one stage")
        start = 0
        for s, st in enumerate(self.stages):
            if st.layers[0] != start:
                raise PlanError(f"plan.stages[{s}].layers starts at {show_repr(st.layers[0])}, expected "
                                f"{show_repr(start)}: stages must cover the layers in order without gaps or overlaps")
            start = st.layers[1]
        if self.workers < 1:
            raise PlanError(f"plan.workers must be >= 1, found {self.workers}")
        ranks = [r for st in self.stages for r in st.ranks]
        dup = _repeated(ranks)
        if dup and self._round_robin():
            if schedule_kind(self.schedule).chunk_order is None:
                raise PlanError(f"plan lists ranks {show_repr(dup)} more than once: stage k on the ranks of stage k "
                                f"mod {self.groups} places chunks round-robin, which only --schedule interleaved runs, "
                                f"found {self.schedule!r}")
            ranks = [r for st in self.stages[:self.groups] for r in st.ranks]
            dup = _repeated(ranks)
        if dup:
            raise PlanError(f"plan lists ranks {show_repr(dup)} more than once; every rank must appear exactly once")
        # distinct ranks, as many as workers, all in [0, workers): each of them once (no list as long as workers)
        if len(ranks) != self.workers or not 0 <= min(ranks, default=0) <= max(ranks, default=0) < self.workers:
            raise PlanError(f"plan.workers={show_repr(self.workers)} but the stages' ranks are "
                            f"{show_repr(sorted(ranks))}; expected each of 0..{show_repr(self.workers - 1)} exactly "
                            "once")
        if num_layers is not None and start != num_layers:
            raise PlanError(f"plan covers layers [0, {show_repr(start)}) but the model has {num_layers} layers")
        if self.extra.get("accumulation", "autograd") not in ACCUMULATIONS:
            raise PlanError(f"plan.accumulation must be one of {', '.join(ACCUMULATIONS)}, found "
                            f"{show_repr(self.extra['accumulation'])}")
        if not isinstance(self.extra.get("shard_optimizer", False), bool):
            raise PlanError("plan.shard_optimizer must be true or false, found "
                            f"{show_repr(self.extra['shard_optimizer'])}")
        warmup = self.extra.get("warmup")
        if warmup is not None:
            if not schedule_kind(self.schedule).warmup_applies:
                raise PlanError(f"plan.warmup applies to schedule {WARMUP_SCHEDULES} only, found {self.schedule!r}")
            if (not isinstance(warmup, list) or len(warmup) != self.groups
                    or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in warmup)):
                raise PlanError(f"plan.warmup must be {self.groups} non-negative integers (forwards before the "
                                f"first backward, one per stage), found {show_repr(warmup)}")
        if world_size is not None and world_size != self.workers:
            raise PlanError(f"plan is for {self.workers} workers but {world_size} processes were started; "
                            f"run mpirun -np {self.workers}")

    def set_schedule(self, name: str) -> None:
        """Run the plan under schedule `name` (a --schedule override): the planner's warm-up, chosen for its own
        schedule, goes with any other (2bw takes a depth too, but one planned for 1f1b's flush would only cost
        it memory); then validated."""
        if name != self.schedule:
            self.extra.pop("warmup", None)
        self.schedule = name
        self.validate()

    def _round_robin(self) -> bool:
        """Stage k runs on the ranks of stage k mod S, for S < the number of stages (interleaved chunks)."""
        S, n = self.groups, len(self.stages)
        return S < n and n % S == 0 and all(st.ranks == self.stages[k % S].ranks for k, st in enumerate(self.stages))

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": PLAN_FORMAT, "schedule": self.schedule, "microbatches": self.microbatches,
                             "workers": self.workers,
                             "stages": [{**asdict(st), "layers": list(st.layers)} for st in self.stages],
                             "predicted": self.predicted}
        d.update(self.extra)
        return d

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def from_json(cls, d: Any, *, source: str = "plan") -> Plan:
        d = check_fields(d, {"schedule": str, "microbatches": int, "workers": int, "stages": list}, source=source,
                         error=PlanError, format=PLAN_FORMAT)
        stages = []
        for s, st in enumerate(d["stages"]):
            where = f"{source}: stages[{s}]"
            if not isinstance(st, dict):
                raise PlanError(f"{where}: expected an object, found {show_repr(st)}")
            layers, replicas, ranks = st.get("layers"), st.get("replicas", 1), st.get("ranks")
            if (not isinstance(layers, list) or len(layers) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)):
                raise PlanError(f"{where}.layers must be [start, end) of two non-negative integers, found "
                                f"{show_repr(layers)}")
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
                raise PlanError(f"{where}.replicas must be a positive integer, found {show_repr(replicas)}")
            if (not isinstance(ranks, list)
                    or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)):
                raise PlanError(f"{where}.ranks must be a list of non-negative integers, found {show_repr(ranks)}")
            try:
                stages.append(StagePlan((layers[0], layers[1]), replicas, list(ranks)))
            except PlanError as e:
                raise PlanError(f"{where}: {e}") from None
        predicted = d.get("predicted", {})
        if not isinstance(predicted, dict):
            raise PlanError(f"{source}: field 'predicted' must be an object, found {show_repr(predicted)}")
        known = {"format", "schedule", "microbatches", "workers", "stages", "predicted"}
        extra = {k: v for k, v in d.items() if k not in known}
        try:
            plan = cls(d["schedule"], d["microbatches"], d["workers"], stages, predicted, extra)
        except PlanError as e:
            raise PlanError(f"{source}: {e}") from None
        if plan.warmup is not None and max(plan.warmup) > plan.microbatches:
            # A stage runs at most m forwards before its first backward: a count past m means m (pipeflow-plan wrote
            # some before it capped them), and 10**400 is not printed back. Here, not in validate: --microbatches may
            # lower m after reading, and the runtime caps the counts itself.
            plan.extra["warmup"] = [min(w, plan.microbatches) for w in plan.warmup]
        return plan

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(read_json(path, "plan.json", PlanError), source=str(path))


def _repeated(ranks: list[int]) -> list[int]:
    """The ranks listed more than once, sorted (in linear time: a plan may list thousands)."""
    return sorted(r for r, n in Counter(ranks).items() if n > 1)


def even_plan(num_layers: int, stages: int, *, schedule: str, microbatches: int,
              layer_counts: list[int] | None = None, virtual_stages: int = 1) -> Plan:
    """A straight plan of `stages` single-replica stages, layers split as evenly as possible
    (earlier stages take the remainder) or by explicit `layer_counts`. With `virtual_stages` v, the
    layers are split into stages*v chunks and chunk k runs on rank k mod stages (round-robin)."""
    if stages < 1:
        raise PlanError(f"need at least one stage, found {stages}")
    workers = stages
    stages *= virtual_stages
    if layer_counts is None:
        if stages > num_layers and virtual_stages > 1:
            raise PlanError(f"cannot split {num_layers} layers into {stages} stages ({workers} ranks x "
                            f"--virtual-stages {virtual_stages}): use fewer virtual stages or processes")
        if stages > num_layers:
            raise PlanError(f"cannot split {num_layers} layers into {stages} stages: "
                            f"use at most {num_layers} processes or a model with more layers")
        q, r = divmod(num_layers, stages)
        layer_counts = [q + (1 if s < r else 0) for s in range(stages)]
    if len(layer_counts) != stages or sum(layer_counts) != num_layers or min(layer_counts) < 1:
        raise PlanError(f"layer counts {layer_counts} must be {stages} positive numbers summing to {num_layers}")
    out, start = [], 0
    for s, n in enumerate(layer_counts):
        out.append(StagePlan((start, start + n), 1, [s % workers]))
        start += n
    return Plan(schedule, microbatches, workers, out)
