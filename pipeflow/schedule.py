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
from pipeflow.kinds import SCHEDULES, TABLE, WARMUP_SCHEDULES, ScheduleKind, fill_warmup, schedule_kind, warmup_forwards

__all__ = ["COMPUTE", "KINDS", "SCHEDULES", "STEP", "TABLE", "Action", "B", "F", "Kind", "Schedule", "ScheduleError",
           "ScheduleKind", "add_communication", "compute_order", "compute_orders", "dependencies", "dry_run",
           "fill_warmup", "from_lists", "generate", "schedule_kind", "validate", "warmup_forwards"]


def compute_order(name: str, microbatches: int, replicas: Sequence[int], worker_mbs: list[int], stage: int, *,
                  minibatch: int | None = None, warmup: int | None = None) -> list[Action]:
    """The compute actions (and STEPs) of one worker, before communication is added. `warmup` overrides
    the forwards before the first backward (1f1b and 2bw)."""
    return schedule_kind(name).order(worker_mbs, microbatches, replicas, stage, minibatch, warmup)


def compute_orders(sched: Schedule, *, minibatch: int | None = None,
                   warmup: Sequence[int] | None = None) -> list[list[Action]]:
    """Every worker's compute actions and STEPs from the schedule's record (before communication)."""
    kind = schedule_kind(sched.name)
    reps = sched.replicas
    if kind.chunk_order is not None:
        return [kind.chunk_order(sched.microbatches_of(w), sched.microbatches, reps, s, sched.virtual_stages)
                for w, (s, _) in enumerate(sched.workers)]
    return [kind.order(sched.microbatches_of(w), sched.microbatches, reps, s, minibatch,
                       None if warmup is None else warmup[s])
            for w, (s, _) in enumerate(sched.workers)]


def add_communication(sched: Schedule, orders: list[list[Action]]) -> list[list[Action]]:
    """Insert SEND right after the compute that produces it and post RECV one compute action early,
    so that the transfer overlaps the preceding computation. Transfers name the compute's stage."""
    out = []
    last = sched.model_stages - 1
    for w, order in enumerate(orders):
        acts: list[Action] = []
        prev_compute = 0  # index in `acts` just before the last compute action
        for a in order:
            s = sched.stage_at(w, a)
            recv = None
            if a.kind is Kind.F and s > 0:
                recv = Action(Kind.RECV_F, a.microbatch, a.stage)
            elif a.kind is Kind.B and s < last:
                recv = Action(Kind.RECV_B, a.microbatch, a.stage)
            if recv is not None:
                acts.insert(prev_compute, recv)
            if a.is_compute:
                prev_compute = len(acts)
            acts.append(a)
            if a.kind is Kind.F and s < last:
                acts.append(Action(Kind.SEND_F, a.microbatch, a.stage))
            elif a.kind is Kind.B and s > 0:
                acts.append(Action(Kind.SEND_B, a.microbatch, a.stage))
        out.append(acts)
    return out


def generate(name: str, stages: int, microbatches: int, replicas: Sequence[int] | None = None, *,
             minibatch: int | None = None, warmup: Sequence[int] | None = None,
             virtual_stages: int = 1) -> Schedule:
    """Build, validate and dry-run a schedule. For `async`/`2bw`, `microbatches` counts all of them
    (steps x m) and `minibatch` is m. `warmup` (1f1b, 2bw): forwards before the first backward, per stage.
    `virtual_stages` v (interleaved only): `stages` rank groups hold S*v model stages round-robin."""
    kind = schedule_kind(name)
    if virtual_stages != 1 and kind.chunk_order is None:
        raise ScheduleError(f"--virtual-stages applies to a schedule that places chunks round-robin "
                            f"({', '.join(k.name for k in TABLE if k.chunk_order is not None)}), not {name!r}")
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"need stages >= 1 and microbatches >= 1, found stages={stages}, "
                            f"microbatches={microbatches}")
    reps = tuple(replicas) if replicas is not None else (1,) * stages
    if len(reps) != stages or any(r < 1 for r in reps):
        raise ScheduleError(f"replicas must be {stages} positive counts, found {list(reps)}")
    if warmup is not None:
        if not kind.warmup_applies:
            raise ScheduleError(f"a warm-up depth applies to {WARMUP_SCHEDULES} only, not {name!r} (its weight "
                                "versions depend on the standard depth)")
        if len(warmup) != stages or any(w < 0 for w in warmup):
            raise ScheduleError(f"warmup must be {stages} non-negative counts (one per stage), found {list(warmup)}")
    sched = Schedule(name, stages, microbatches, reps, virtual_stages=virtual_stages)
    orders = compute_orders(sched, minibatch=minibatch, warmup=warmup)
    sched.actions = add_communication(sched, orders)
    validate(sched)
    dry_run(sched)
    return sched


# ---------------------------------------------------------------- validation and dry run


def _fail(sched: Schedule, msg: str, mark: dict[int, int] | None = None) -> ScheduleError:
    return ScheduleError(f"{msg}\n{sched.render(mark)}")


def _label(kind: Kind, stage: int | None, i: int) -> str:
    """An action's text as the IR prints it (`F3`, or `1F3` when it names its stage)."""
    return str(Action(kind, i, stage))


def validate(sched: Schedule) -> None:
    """Every microbatch of a worker: forward then backward exactly once on each stage it holds; RECV before
    and SEND after the compute they serve; per channel, sends and receives in the same order. A schedule that
    splits the backward (any W) runs W once per microbatch, after its B and before the next STEP (ZB ICLR'24 §2)."""
    split = any(a.kind is Kind.W for acts in sched.actions for a in acts)
    # (src, dst, F|B) -> [(what, index)]: one channel carries every chunk's messages between two workers.
    channels: dict[tuple[int, int, Kind], list[tuple[object, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int, Kind], list[tuple[object, int]]] = defaultdict(list)
    steps = [0] * len(sched.workers)
    last = sched.model_stages - 1
    chunked = sched.virtual_stages > 1
    for w, acts in enumerate(sched.actions):
        g = sched.stage_of(w)
        mine = set(sched.microbatches_of(w))
        held = sched.chunks_of(w)
        seen: dict[tuple[Kind, int, int], int] = {}
        names: dict[int, int | None] = {}  # model stage -> the stage field its actions carry
        no_w: set[tuple[int, int]] = set()  # (microbatch, stage) of each B whose W has not run (split backward)
        for idx, a in enumerate(acts):
            if a.kind is Kind.STEP:
                steps[w] += 1
                if split and no_w:
                    i0, k0 = min(no_w)
                    missing = _label(Kind.W, names.get(k0), i0)
                    raise _fail(sched, f"worker {w} runs STEP before {missing}: a weight gradient must be "
                                       "accumulated before the step that uses it", {w: idx})
                continue
            assert a.microbatch is not None
            i = a.microbatch
            if chunked and a.stage is None:
                raise _fail(sched, f"worker {w} runs {a} without a stage: with {sched.virtual_stages} virtual "
                                   f"stages every action names its stage (e.g. {g}{a})", {w: idx})
            k = sched.stage_at(w, a)
            if k not in held:
                raise _fail(sched, f"worker {w} runs {a}, but stage {k} is not one of its stages {held} "
                                   f"(stage k runs on group k mod {sched.stages})", {w: idx})
            names.setdefault(k, a.stage)
            if i not in mine:
                raise _fail(sched, f"worker {w} runs {a}, but microbatch {i} belongs to replica "
                                   f"{i % sched.replicas[g]} of stage {g}", {w: idx})
            if (a.kind, k, i) in seen:
                raise _fail(sched, f"worker {w} runs {a} twice (steps {seen[(a.kind, k, i)]} and {idx})", {w: idx})
            seen[(a.kind, k, i)] = idx
            if split and a.kind is Kind.B:
                no_w.add((i, k))
            elif a.kind is Kind.W:
                no_w.discard((i, k))
            if a.kind is Kind.B and (Kind.F, k, i) not in seen:
                raise _fail(sched, f"worker {w} runs {a} before {_label(Kind.F, a.stage, i)}", {w: idx})
            if a.kind is Kind.W and (Kind.B, k, i) not in seen:
                raise _fail(sched, f"worker {w} runs {a} before {_label(Kind.B, a.stage, i)}", {w: idx})
            if a.kind.is_send or a.kind.is_recv:
                peer = sched.peer(w, a)
                direction = a.kind.direction
                # Named by the sending stage: (k, i) on the sender is (k+1, i) or (k-1, i) on the receiver.
                what = (k if a.kind.is_send else k - 1 if direction is Kind.F else k + 1, i) if chunked else i
                if a.kind.is_send:
                    if (direction, k, i) not in seen:
                        raise _fail(sched, f"worker {w} runs {a} before {_label(direction, a.stage, i)}", {w: idx})
                    channels[(w, peer, direction)].append((what, idx))
                else:
                    recvs[(peer, w, direction)].append((what, idx))
        for k in held:
            st = names.get(k, k if chunked else None)
            for i in sorted(mine):
                def at(kind: Kind, k: int = k, i: int = i, seen: dict[tuple[Kind, int, int], int] = seen) -> int:
                    return seen[(kind, k, i)]

                def name(kind: Kind, st: int | None = st, i: int = i) -> str:
                    return _label(kind, st, i)
                for kind in (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B):
                    if (kind, k, i) not in seen:
                        raise _fail(sched, f"worker {w} (stage {k}) never runs {name(kind)}", {w: len(acts) - 1})
                if k > 0 and (Kind.RECV_F, k, i) not in seen:
                    raise _fail(sched, f"worker {w} runs {name(Kind.F)} without {name(Kind.RECV_F)}",
                                {w: at(Kind.F)})
                if k > 0 and at(Kind.RECV_F) > at(Kind.F):
                    raise _fail(sched, f"worker {w} posts {name(Kind.RECV_F)} after {name(Kind.F)}",
                                {w: at(Kind.RECV_F)})
                if k < last and ((Kind.RECV_B, k, i) not in seen or at(Kind.RECV_B) > at(Kind.B)):
                    raise _fail(sched, f"worker {w} runs {name(Kind.B)} without a {name(Kind.RECV_B)} before it",
                                {w: at(Kind.B)})
                if k < last and (Kind.SEND_F, k, i) not in seen:
                    raise _fail(sched, f"worker {w} never runs {name(Kind.SEND_F)}", {w: at(Kind.F)})
                if k > 0 and (Kind.SEND_B, k, i) not in seen:
                    raise _fail(sched, f"worker {w} never runs {name(Kind.SEND_B)}", {w: at(Kind.B)})
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
    send_at: dict[tuple[int, int, Kind, int, int], int] = {}  # (src, dst, F|B, sender's stage, mb) -> index
    step_at: dict[tuple[int, int], int] = {}
    last = sched.model_stages - 1
    for w, acts in enumerate(sched.actions):
        k = 0
        for idx, a in enumerate(acts):
            if a.kind.is_send:
                assert a.microbatch is not None
                key = (w, sched.peer(w, a), a.kind.direction, sched.stage_at(w, a), a.microbatch)
                send_at[key] = idx
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
            at = sched.stage_at(w, a) if a.kind is not Kind.STEP else s
            needs_input = (a.kind is Kind.F and at > 0) or (a.kind is Kind.B and at < last)
            if needs_input:
                assert a.microbatch is not None
                src = sched.peer(w, Action(RECV[a.kind], a.microbatch, a.stage))
                d.append((src, send_at[(src, w, a.kind, at - 1 if a.kind is Kind.F else at + 1, a.microbatch)]))
            elif a.kind is Kind.STEP:
                for r in range(sched.replicas[s]):
                    other = sched.worker(s, r)
                    if other != w and step_at[(other, k)] > 0:
                        d.append((other, step_at[(other, k)] - 1))
                k += 1
            mine.append(d)
        deps.append(mine)
    return deps


def dry_run(sched: Schedule, deps: list[list[list[tuple[int, int]]]] | None = None) -> list[tuple[int, int]]:
    """Play all workers' lists against each other with non-blocking sends and receives that complete
    when the matching send was posted (or `deps`: dependencies(sched) with more waits). Returns the global order of
    (worker, index) executed; raises ScheduleError with the grid, stuck actions marked, on a deadlock."""
    deps = dependencies(sched) if deps is None else deps
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
               replicas: Sequence[int] | None = None, *, virtual_stages: int = 1) -> Schedule:
    """A schedule from hand-written action strings; validated and dry-run like generated ones."""
    sched = Schedule(name, stages, microbatches, tuple(replicas or (1,) * stages), virtual_stages=virtual_stages)
    sched.actions = [[Action.parse(x) for x in acts] for acts in lists]
    if len(sched.actions) != len(sched.workers):
        raise ScheduleError(f"{len(sched.actions)} action lists for {len(sched.workers)} workers")
    validate(sched)
    dry_run(sched)
    return sched
