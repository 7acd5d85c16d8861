"""Pipeline schedules as data: per-worker action lists, generators, validation and a dry run.

Pure: no torch.distributed, no mpi4py. A *worker* is one (stage, replica) pair; workers are
numbered stage-major, so with replicas (2, 1, 1) workers 0, 1 are stage 0 and worker 2 is
stage 1. Replica r of stage s runs the microbatches i with i % replicas[s] == r
(PipeDream's 1F1B-RR), and sends microbatch i to replica i % replicas[s + 1] downstream.

Generated lists for S=3 stages, m=4 microbatches (compute actions only)::

    gpipe   s0: F0 F1 F2 F3 B0 B1 B2 B3 STEP      1f1b  s0: F0 F1 F2 B0 F3 B1 B2 B3 STEP
            s1: F0 F1 F2 F3 B0 B1 B2 B3 STEP            s1: F0 F1 B0 F2 B1 F3 B2 B3 STEP
            s2: F0 F1 F2 F3 B0 B1 B2 B3 STEP            s2: F0 B0 F1 B1 F2 B2 F3 B3 STEP

`async` is 1f1b without the flush: STEP after every backward (PipeDream SOSP'19 §3.3).
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

COMPUTE = ("F", "B", "W")
KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "STEP")
SCHEDULES = ("gpipe", "1f1b", "async", "2bw")
# Schedules that step once per minibatch after a flush; gradients equal to gpipe's.
FLUSH_SCHEDULES = ("gpipe", "1f1b")

_ACTION_RE = re.compile(r"^(\d+)?(SEND_F|RECV_F|SEND_B|RECV_B|STEP|F|B|W)(\d+)?$")


class ScheduleError(ValueError):
    """A schedule that is malformed, inconsistent or deadlocks; the message holds its grid."""


@dataclass(frozen=True, order=True)
class Action:
    """`F3`, `SEND_B3`, `STEP`; with a (virtual) stage prefix: `1F3`. str() round-trips with parse()."""

    kind: str
    microbatch: int | None = None
    stage: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")
        if (self.kind == "STEP") != (self.microbatch is None):
            raise ValueError(f"{self.kind} {'takes no' if self.kind == 'STEP' else 'needs a'} microbatch")

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
        return cls(kind, None if mb is None else int(mb), None if stage is None else int(stage))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


def F(i: int) -> Action:
    return Action("F", i)


def B(i: int) -> Action:
    return Action("B", i)


STEP = Action("STEP")


@dataclass
class Schedule:
    """Per-worker action lists of one schedule over `stages` stages and `microbatches` microbatches."""

    name: str
    stages: int
    microbatches: int
    replicas: tuple[int, ...]
    actions: list[list[Action]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.replicas) != self.stages:
            raise ScheduleError(f"replicas {self.replicas} has {len(self.replicas)} entries, expected {self.stages}")

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
        s = self.stage_of(worker)
        assert action.microbatch is not None
        downstream = action.kind in ("SEND_F", "RECV_B")
        t = s + 1 if downstream else s - 1
        if not 0 <= t < self.stages:
            raise ScheduleError(f"{action} on stage {s} has no peer stage {t}\n{self.render()}")
        return self.worker(t, action.microbatch % self.replicas[t])

    def render(self, mark: dict[int, int] | None = None, labels: Sequence[str] | None = None) -> str:
        """Step x worker grid; `mark` maps worker -> step index flagged `<-- ERROR HERE`."""
        mark = mark or {}
        labels = list(labels or [f"s{s}r{r}" if self.replicas[s] > 1 else f"s{s}" for s, r in self.workers])
        cells = [[str(a) for a in acts] for acts in self.actions]
        for w, i in mark.items():
            if i < len(cells[w]):
                cells[w][i] = f"*{cells[w][i]}*"
        width = max([len(x) for x in labels] + [len(c) for col in cells for c in col] + [4])
        rows = [f"{self.name} S={self.stages} m={self.microbatches} replicas={list(self.replicas)}",
                "step  " + " ".join(x.ljust(width) for x in labels)]
        for step in range(max((len(c) for c in cells), default=0)):
            row = " ".join((col[step] if step < len(col) else "").ljust(width) for col in cells)
            flag = "  <-- ERROR HERE" if any(i == step for i in mark.values()) else ""
            rows.append(f"{step:<5} {row}".rstrip() + flag)
        return "\n".join(rows)

    def format_lists(self) -> str:
        return "\n".join(f"{w}: " + " ".join(map(str, acts)) for w, acts in enumerate(self.actions))


# ---------------------------------------------------------------- generators


def warmup_forwards(replicas: Sequence[int], stage: int) -> int:
    """Forwards a stage runs before its first backward in 1F1B: enough to fill the workers downstream.

    With one replica per stage this is S-1-s (DAPPLE / PipeDream-Flush); with replicas it is
    PipeDream's NOAM ceil(workers from s on / replicas of s) minus the one in flight here.
    """
    return max(0, math.ceil(sum(replicas[stage:]) / replicas[stage]) - 1)


def fill_warmup(replicas: Sequence[int], stage: int, *, backward_ratio: float = 2.0) -> int:
    """Forwards that keep a stage busy until its first gradient returns, for stages of equal cost with
    backward = `backward_ratio` x forward: the round trip to the last stage and back takes
    (1 + ratio) x warmup_forwards forward-times. DAPPLE's minimum leaves the first stages idle that
    long once per minibatch; when the first stage is the bottleneck that idle time is lost throughput.
    Costs memory: that many more microbatches' activations in flight."""
    return math.ceil((1 + backward_ratio) * warmup_forwards(replicas, stage))


def _one_f_one_b(mbs: list[int], warmup: int) -> list[Action]:
    warmup = min(warmup, len(mbs))
    order = [F(i) for i in mbs[:warmup]]
    for k, i in enumerate(mbs[warmup:]):
        order += [F(i), B(mbs[k])]
    order += [B(i) for i in mbs[len(mbs) - warmup:]] if warmup else []
    return order


def compute_order(name: str, stages: int, microbatches: int, replicas: Sequence[int], worker_mbs: list[int],
                  stage: int, *, minibatch: int | None = None, warmup: int | None = None) -> list[Action]:
    """The compute actions (and STEPs) of one worker, before communication is added. `warmup` overrides
    the forwards before the first backward (1f1b only)."""
    if name == "gpipe":
        return [F(i) for i in worker_mbs] + [B(i) for i in worker_mbs] + [STEP]
    order = _one_f_one_b(worker_mbs, warmup_forwards(replicas, stage) if warmup is None else warmup)
    if name == "1f1b":
        return order + [STEP]
    if name == "async":
        # PipeDream: an update after every backward, no flush; replicas all-reduce at every STEP, so
        # they must run equally many backwards.
        if microbatches % replicas[stage]:
            raise ScheduleError(f"async: stage {stage} has {replicas[stage]} replicas, which must divide the "
                                f"total number of microbatches (steps x m), found {microbatches}")
        return [a for x in order for a in ((x, STEP) if x.kind == "B" else (x,))]
    if name == "2bw":
        # PipeDream-2BW: 1F1B without flush; an update after this worker's last backward of each minibatch
        # (with replicas, every replica owns a share of each minibatch: needs m >= replicas).
        if not minibatch or minibatch < 1:
            raise ScheduleError(f"2bw needs the minibatch size in microbatches, found {minibatch}")
        if minibatch < replicas[stage] or microbatches % minibatch:
            raise ScheduleError(f"2bw: stage {stage} has {replicas[stage]} replicas and minibatches of {minibatch} "
                                f"microbatches over {microbatches} in all; need m >= replicas and m dividing the "
                                "total, so that every replica steps once per minibatch")
        last = {max(i for i in worker_mbs if i // minibatch == k) for k in {i // minibatch for i in worker_mbs}}
        out: list[Action] = []
        for x in order:
            out.append(x)
            if x.kind == "B" and x.microbatch in last:
                out.append(STEP)
        return out
    raise ScheduleError(f"unknown schedule {name!r}; expected one of {SCHEDULES}")


def add_communication(sched: Schedule, orders: list[list[Action]]) -> list[list[Action]]:
    """Insert SEND right after the compute that produces it and post RECV one compute action early,
    so that the transfer overlaps the preceding computation."""
    out = []
    for w, order in enumerate(orders):
        s = sched.stage_of(w)
        acts: list[Action] = []
        prev_compute = 0  # index in `acts` just before the last compute action
        for a in order:
            recv = None
            if a.kind == "F" and s > 0:
                recv = Action("RECV_F", a.microbatch)
            elif a.kind == "B" and s < sched.stages - 1:
                recv = Action("RECV_B", a.microbatch)
            if recv is not None:
                acts.insert(prev_compute, recv)
            if a.is_compute:
                prev_compute = len(acts)
            acts.append(a)
            if a.kind == "F" and s < sched.stages - 1:
                acts.append(Action("SEND_F", a.microbatch))
            elif a.kind == "B" and s > 0:
                acts.append(Action("SEND_B", a.microbatch))
        out.append(acts)
    return out


def generate(name: str, stages: int, microbatches: int, replicas: Sequence[int] | None = None, *,
             minibatch: int | None = None, warmup: Sequence[int] | None = None) -> Schedule:
    """Build, validate and dry-run a schedule. For `async`/`2bw`, `microbatches` counts all of them
    (steps x m) and `minibatch` is m. `warmup` (1f1b only): forwards before the first backward, per stage."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"need stages >= 1 and microbatches >= 1, found stages={stages}, "
                            f"microbatches={microbatches}")
    reps = tuple(replicas) if replicas is not None else (1,) * stages
    if len(reps) != stages or any(r < 1 for r in reps):
        raise ScheduleError(f"replicas must be {stages} positive counts, found {list(reps)}")
    if warmup is not None:
        if name != "1f1b":
            raise ScheduleError(f"a warm-up depth applies to 1f1b only, not {name!r} (its weight versions depend "
                                "on the standard depth)")
        if len(warmup) != stages or any(w < 0 for w in warmup):
            raise ScheduleError(f"warmup must be {stages} non-negative counts (one per stage), found {list(warmup)}")
    sched = Schedule(name, stages, microbatches, reps)
    orders = [compute_order(name, stages, microbatches, reps, sched.microbatches_of(w), s, minibatch=minibatch,
                            warmup=None if warmup is None else warmup[s])
              for w, (s, _) in enumerate(sched.workers)]
    sched.actions = add_communication(sched, orders)
    validate(sched)
    dry_run(sched)
    return sched


# ---------------------------------------------------------------- validation and dry run


def _fail(sched: Schedule, msg: str, mark: dict[int, int] | None = None) -> ScheduleError:
    return ScheduleError(f"{msg}\n{sched.render(mark)}")


def validate(sched: Schedule) -> None:
    """Every microbatch of a worker: forward then backward exactly once; RECV before and SEND after
    the compute they serve; per channel, sends and receives in the same order."""
    channels: dict[tuple[int, int, str], list[tuple[int, int]]] = defaultdict(list)  # (src,dst,F|B) -> [mb]
    recvs: dict[tuple[int, int, str], list[tuple[int, int]]] = defaultdict(list)
    steps = [0] * len(sched.workers)
    for w, acts in enumerate(sched.actions):
        s = sched.stage_of(w)
        mine = set(sched.microbatches_of(w))
        seen: dict[tuple[str, int], int] = {}
        for idx, a in enumerate(acts):
            if a.kind == "STEP":
                steps[w] += 1
                continue
            assert a.microbatch is not None
            i = a.microbatch
            if i not in mine:
                raise _fail(sched, f"worker {w} runs {a}, but microbatch {i} belongs to replica "
                                   f"{i % sched.replicas[s]} of stage {s}", {w: idx})
            if (a.kind, i) in seen:
                raise _fail(sched, f"worker {w} runs {a} twice (steps {seen[(a.kind, i)]} and {idx})", {w: idx})
            seen[(a.kind, i)] = idx
            if a.kind == "B" and ("F", i) not in seen:
                raise _fail(sched, f"worker {w} runs {a} before F{i}", {w: idx})
            if a.kind in ("RECV_F", "RECV_B", "SEND_F", "SEND_B"):
                peer = sched.peer(w, a)
                direction = a.kind[-1]
                if a.kind.startswith("SEND"):
                    if (direction, i) not in seen:
                        raise _fail(sched, f"worker {w} runs {a} before {direction}{i}", {w: idx})
                    channels[(w, peer, direction)].append((i, idx))
                else:
                    recvs[(peer, w, direction)].append((i, idx))
        for i in sorted(mine):
            for kind in ("F", "B"):
                if (kind, i) not in seen:
                    raise _fail(sched, f"worker {w} (stage {s}) never runs {kind}{i}", {w: len(acts) - 1})
            if s > 0 and ("RECV_F", i) not in seen:
                raise _fail(sched, f"worker {w} runs F{i} without RECV_F{i}", {w: seen[("F", i)]})
            if s > 0 and seen[("RECV_F", i)] > seen[("F", i)]:
                raise _fail(sched, f"worker {w} posts RECV_F{i} after F{i}", {w: seen[("RECV_F", i)]})
            if s < sched.stages - 1 and (("RECV_B", i) not in seen or seen[("RECV_B", i)] > seen[("B", i)]):
                raise _fail(sched, f"worker {w} runs B{i} without a RECV_B{i} before it", {w: seen[("B", i)]})
            if s < sched.stages - 1 and ("SEND_F", i) not in seen:
                raise _fail(sched, f"worker {w} never runs SEND_F{i}", {w: seen[("F", i)]})
            if s > 0 and ("SEND_B", i) not in seen:
                raise _fail(sched, f"worker {w} never runs SEND_B{i}", {w: seen[("B", i)]})
    for key in set(channels) | set(recvs):
        sent = [i for i, _ in channels.get(key, [])]
        got = [i for i, _ in recvs.get(key, [])]
        if sent != got:
            src, dst, d = key
            raise _fail(sched, f"channel {src}->{dst} ({d}): sends {sent} but receives {got}; "
                               "sends and receives must match in order")
    for s in range(sched.stages):
        ws = [sched.worker(s, r) for r in range(sched.replicas[s])]
        counts = {steps[w] for w in ws}
        if len(counts) > 1:
            raise _fail(sched, f"replicas of stage {s} take different numbers of STEPs: "
                               f"{[steps[w] for w in ws]}; their all-reduces would not match")


def dependencies(sched: Schedule) -> list[list[list[tuple[int, int]]]]:
    """deps[w][i]: the (worker, index) actions that action i of worker w waits for, besides the
    previous action of w. Posting a RECV waits for nothing; the compute that consumes it waits for
    the peer's SEND. A STEP waits for the actions just before the matching STEP of the other
    replicas of its stage (their all-reduce)."""
    send_at: dict[tuple[int, int, str, int], int] = {}
    step_at: dict[tuple[int, int], int] = {}
    for w, acts in enumerate(sched.actions):
        k = 0
        for idx, a in enumerate(acts):
            if a.kind.startswith("SEND"):
                assert a.microbatch is not None
                send_at[(w, sched.peer(w, a), a.kind[-1], a.microbatch)] = idx
            elif a.kind == "STEP":
                step_at[(w, k)] = idx
                k += 1
    deps: list[list[list[tuple[int, int]]]] = []
    for w, acts in enumerate(sched.actions):
        s = sched.stage_of(w)
        mine: list[list[tuple[int, int]]] = []
        k = 0
        for a in acts:
            d: list[tuple[int, int]] = []
            needs_input = (a.kind == "F" and s > 0) or (a.kind == "B" and s < sched.stages - 1)
            if needs_input:
                assert a.microbatch is not None
                src = sched.peer(w, Action("RECV_" + a.kind, a.microbatch))
                d.append((src, send_at[(src, w, a.kind, a.microbatch)]))
            elif a.kind == "STEP":
                for r in range(sched.replicas[s]):
                    other = sched.worker(s, r)
                    if other != w and step_at[(other, k)] > 0:
                        d.append((other, step_at[(other, k)] - 1))
                k += 1
            mine.append(d)
        deps.append(mine)
    return deps


def dry_run(sched: Schedule) -> list[tuple[int, int]]:
    """Play all workers' lists against each other with non-blocking sends and receives that complete
    when the matching send was posted. Returns the global order of (worker, index) executed; raises
    ScheduleError with the grid, stuck actions marked, on a deadlock."""
    deps = dependencies(sched)
    pos = [0] * len(sched.actions)
    done: set[tuple[int, int]] = set()
    order: list[tuple[int, int]] = []
    progress = True
    while progress:
        progress = False
        for w, acts in enumerate(sched.actions):
            while pos[w] < len(acts) and all(d in done for d in deps[w][pos[w]]):
                done.add((w, pos[w]))
                order.append((w, pos[w]))
                pos[w] += 1
                progress = True
    stuck = {w: p for w, p in enumerate(pos) if p < len(sched.actions[w])}
    if stuck:
        what = ", ".join(f"worker {w} at {sched.actions[w][p]}" for w, p in stuck.items())
        raise _fail(sched, f"deadlock: {what} can never proceed", stuck)
    return order


def from_lists(name: str, stages: int, microbatches: int, lists: Iterable[Iterable[str]],
               replicas: Sequence[int] | None = None) -> Schedule:
    """A schedule from hand-written action strings; validated and dry-run like generated ones."""
    sched = Schedule(name, stages, microbatches, tuple(replicas or (1,) * stages))
    sched.actions = [[Action.parse(x) for x in acts] for acts in lists]
    if len(sched.actions) != len(sched.workers):
        raise ScheduleError(f"{len(sched.actions)} action lists for {len(sched.workers)} workers")
    validate(sched)
    dry_run(sched)
    return sched
