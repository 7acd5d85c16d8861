"""Pipeline schedules as data: per-worker action lists generated from the kind table, validation and a dry run.

Pure: no torch.distributed, no mpi4py. The IR (Action, Kind, Schedule) is in actions.py, each schedule's rules
and generator in kinds.py; both are re-exported here.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from pipeflow.actions import (
    COMPUTE,
    KINDS,
    RECV,
    STEP,
    Action,
    B,
    F,
    Kind,
    Schedule,
    ScheduleError,
)
from pipeflow.kinds import SCHEDULES, TABLE, ScheduleKind, fill_warmup, schedule_kind, warmup_forwards

__all__ = ["COMPUTE", "KINDS", "SCHEDULES", "STEP", "TABLE", "Action", "B", "F", "Kind", "Schedule", "ScheduleError",
           "ScheduleKind", "add_communication", "compute_order", "dependencies", "dry_run", "fill_warmup",
           "from_lists", "generate", "schedule_kind", "validate", "warmup_forwards"]


def compute_order(name: str, microbatches: int, replicas: Sequence[int], worker_mbs: list[int], stage: int, *,
                  minibatch: int | None = None, warmup: int | None = None) -> list[Action]:
    """The compute actions (and STEPs) of one worker, before communication is added. `warmup` overrides
    the forwards before the first backward (1f1b only)."""
    return schedule_kind(name).order(worker_mbs, microbatches, replicas, stage, minibatch, warmup)


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
            if a.kind is Kind.F and s > 0:
                recv = Action(Kind.RECV_F, a.microbatch)
            elif a.kind is Kind.B and s < sched.stages - 1:
                recv = Action(Kind.RECV_B, a.microbatch)
            if recv is not None:
                acts.insert(prev_compute, recv)
            if a.is_compute:
                prev_compute = len(acts)
            acts.append(a)
            if a.kind is Kind.F and s < sched.stages - 1:
                acts.append(Action(Kind.SEND_F, a.microbatch))
            elif a.kind is Kind.B and s > 0:
                acts.append(Action(Kind.SEND_B, a.microbatch))
        out.append(acts)
    return out


def generate(name: str, stages: int, microbatches: int, replicas: Sequence[int] | None = None, *,
             minibatch: int | None = None, warmup: Sequence[int] | None = None) -> Schedule:
    """Build, validate and dry-run a schedule. For `async`/`2bw`, `microbatches` counts all of them
    (steps x m) and `minibatch` is m. `warmup` (1f1b only): forwards before the first backward, per stage."""
    kind = schedule_kind(name)
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"need stages >= 1 and microbatches >= 1, found stages={stages}, "
                            f"microbatches={microbatches}")
    reps = tuple(replicas) if replicas is not None else (1,) * stages
    if len(reps) != stages or any(r < 1 for r in reps):
        raise ScheduleError(f"replicas must be {stages} positive counts, found {list(reps)}")
    if warmup is not None:
        if not kind.warmup_applies:
            raise ScheduleError(f"a warm-up depth applies to 1f1b only, not {name!r} (its weight versions depend "
                                "on the standard depth)")
        if len(warmup) != stages or any(w < 0 for w in warmup):
            raise ScheduleError(f"warmup must be {stages} non-negative counts (one per stage), found {list(warmup)}")
    sched = Schedule(name, stages, microbatches, reps)
    orders = [kind.order(sched.microbatches_of(w), microbatches, reps, s, minibatch,
                         None if warmup is None else warmup[s])
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
    the compute they serve; per channel, sends and receives in the same order. A schedule that splits the
    backward (any W) runs W once per microbatch, after its B and before the next STEP (ZB ICLR'24 §2)."""
    split = any(a.kind is Kind.W for acts in sched.actions for a in acts)
    channels: dict[tuple[int, int, Kind], list[tuple[int, int]]] = defaultdict(list)  # (src,dst,F|B) -> [mb]
    recvs: dict[tuple[int, int, Kind], list[tuple[int, int]]] = defaultdict(list)
    steps = [0] * len(sched.workers)
    for w, acts in enumerate(sched.actions):
        s = sched.stage_of(w)
        mine = set(sched.microbatches_of(w))
        seen: dict[tuple[Kind, int], int] = {}
        for idx, a in enumerate(acts):
            if a.kind is Kind.STEP:
                steps[w] += 1
                late = sorted(i for k, i in seen if k is Kind.B and (Kind.W, i) not in seen) if split else []
                if late:
                    raise _fail(sched, f"worker {w} runs STEP before W{late[0]}: a weight gradient must be "
                                       "accumulated before the step that uses it", {w: idx})
                continue
            assert a.microbatch is not None
            i = a.microbatch
            if i not in mine:
                raise _fail(sched, f"worker {w} runs {a}, but microbatch {i} belongs to replica "
                                   f"{i % sched.replicas[s]} of stage {s}", {w: idx})
            if (a.kind, i) in seen:
                raise _fail(sched, f"worker {w} runs {a} twice (steps {seen[(a.kind, i)]} and {idx})", {w: idx})
            seen[(a.kind, i)] = idx
            if a.kind is Kind.B and (Kind.F, i) not in seen:
                raise _fail(sched, f"worker {w} runs {a} before F{i}", {w: idx})
            if a.kind is Kind.W and (Kind.B, i) not in seen:
                raise _fail(sched, f"worker {w} runs {a} before B{i}", {w: idx})
            if a.kind.is_send or a.kind.is_recv:
                peer = sched.peer(w, a)
                direction = a.kind.direction
                if a.kind.is_send:
                    if (direction, i) not in seen:
                        raise _fail(sched, f"worker {w} runs {a} before {direction}{i}", {w: idx})
                    channels[(w, peer, direction)].append((i, idx))
                else:
                    recvs[(peer, w, direction)].append((i, idx))
        for i in sorted(mine):
            for kind in (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B):
                if (kind, i) not in seen:
                    raise _fail(sched, f"worker {w} (stage {s}) never runs {kind}{i}", {w: len(acts) - 1})
            if s > 0 and (Kind.RECV_F, i) not in seen:
                raise _fail(sched, f"worker {w} runs F{i} without RECV_F{i}", {w: seen[(Kind.F, i)]})
            if s > 0 and seen[(Kind.RECV_F, i)] > seen[(Kind.F, i)]:
                raise _fail(sched, f"worker {w} posts RECV_F{i} after F{i}", {w: seen[(Kind.RECV_F, i)]})
            if s < sched.stages - 1 and ((Kind.RECV_B, i) not in seen or seen[(Kind.RECV_B, i)] > seen[(Kind.B, i)]):
                raise _fail(sched, f"worker {w} runs B{i} without a RECV_B{i} before it", {w: seen[(Kind.B, i)]})
            if s < sched.stages - 1 and (Kind.SEND_F, i) not in seen:
                raise _fail(sched, f"worker {w} never runs SEND_F{i}", {w: seen[(Kind.F, i)]})
            if s > 0 and (Kind.SEND_B, i) not in seen:
                raise _fail(sched, f"worker {w} never runs SEND_B{i}", {w: seen[(Kind.B, i)]})
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
    send_at: dict[tuple[int, int, Kind, int], int] = {}
    step_at: dict[tuple[int, int], int] = {}
    for w, acts in enumerate(sched.actions):
        k = 0
        for idx, a in enumerate(acts):
            if a.kind.is_send:
                assert a.microbatch is not None
                send_at[(w, sched.peer(w, a), a.kind.direction, a.microbatch)] = idx
            elif a.kind is Kind.STEP:
                step_at[(w, k)] = idx
                k += 1
    deps: list[list[list[tuple[int, int]]]] = []
    for w, acts in enumerate(sched.actions):
        s = sched.stage_of(w)
        mine: list[list[tuple[int, int]]] = []
        k = 0
        for a in acts:
            d: list[tuple[int, int]] = []
            needs_input = (a.kind is Kind.F and s > 0) or (a.kind is Kind.B and s < sched.stages - 1)
            if needs_input:
                assert a.microbatch is not None
                src = sched.peer(w, Action(RECV[a.kind], a.microbatch))
                d.append((src, send_at[(src, w, a.kind, a.microbatch)]))
            elif a.kind is Kind.STEP:
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
