"""Compute orders of the zero-bubble schedules, ZB-H1 and ZB-H2 (Qi et al., ICLR'24 §2), with replicas (pure).

The backward is split into B (input gradient, on the critical path) and W (weight gradient, needed only by the
STEP). Each worker keeps 1F1B's order of F and B (PipeDream-Flush, 1F1B-RR ownership with replicas) with a
given warm-up, and W fills the time the next F or B would wait: the orders come from replaying every worker at
once with the paper's unit costs T_F = T_B = T_W (no communication time), where a worker that is free runs

1. its next F or B if its input has arrived and, for an F, it holds fewer than `limit` microbatches (forward
   run, W not yet: their activations are alive);
2. otherwise its oldest pending W;

and the W still pending at the end run before the STEP. ZB-H1 (§2.1): 1F1B's warm-up, limit ceil(N / r) for N
workers and r replicas of the stage, at most what 1F1B's busiest worker holds (S with one replica per stage:
1F1B's first-stage count, its peak, on every stage), which delays W on the later stages by as many
microbatches as their warm-up is shorter; bubble (S-1)(T_F + T_B - T_W) against 1F1B's (S-1)(T_F + T_B + T_W).
ZB-H2 (§2.2): twice 1F1B's warm-up and twice the limit minus one (the paper's 2S - 1): the warm-up forwards fill
the wait for the first B and the W fill the drain, so every worker is busy from its first action to its last
(the paper's parallelogram).

S=4, m=8, one replica per stage::

    zb    s0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
          s3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7
    zb-h2 s0: F0 F1 F2 F3 F4 F5 F6 B0 W0 F7 B1 B2 W1 W2 B3 B4 W3 W4 B5 B6 W5 W6 B7 W7
          s3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1 W2 W3 W4 W5 W6 W7
"""
from __future__ import annotations

import collections
import functools
import heapq
from collections.abc import Sequence

from pipeflow.actions import STEP, Action, Kind, ScheduleError


def zero_bubble_order(mbs: list[int], microbatches: int, replicas: Sequence[int], stage: int, *,
                      warmups: Sequence[int], limits: Sequence[int]) -> list[Action]:
    """The compute actions and the STEP of the worker of `stage` that owns `mbs` (module docstring)."""
    if not mbs:
        return [STEP]
    orders = _orders(microbatches, tuple(replicas), tuple(warmups), tuple(limits))
    worker = sum(replicas[:stage]) + mbs[0] % replicas[stage]
    return [*orders[worker], STEP]


def _fb_order(mbs: list[int], warmup: int) -> list[Action]:
    """1F1B's order of F and B over `mbs` with `warmup` forwards before the first backward."""
    w = min(warmup, len(mbs))
    out = [Action(Kind.F, i) for i in mbs[:w]]
    for k, i in enumerate(mbs[w:]):
        out += [Action(Kind.F, i), Action(Kind.B, mbs[k])]
    return out + [Action(Kind.B, i) for i in mbs[len(mbs) - w:]]


@functools.lru_cache(maxsize=64)
def _orders(m: int, replicas: tuple[int, ...], warmups: tuple[int, ...],
            limits: tuple[int, ...]) -> tuple[tuple[Action, ...], ...]:
    """Every worker's compute order (stage-major), from the unit-cost replay of the module docstring."""
    S = len(replicas)
    workers = [(s, r) for s in range(S) for r in range(replicas[s])]
    fb = [_fb_order(list(range(r, m, replicas[s])), warmups[s]) for s, r in workers]
    # An F waits for a W only while one is pending: the limit must let the warm-up and the next F run.
    if any(limits[s] < min(warmups[s] + 1, len(fb[w]) // 2) for w, (s, _) in enumerate(workers)):
        raise ScheduleError(f"zero-bubble limits {list(limits)} must exceed the warm-ups {list(warmups)}")
    n = len(workers)
    pos, live = [0] * n, [0] * n
    pending: list[collections.deque[int]] = [collections.deque() for _ in range(n)]
    out: list[list[Action]] = [[] for _ in range(n)]
    done: dict[tuple[Kind, int, int], int] = {}  # (F|B, stage, microbatch) -> time it ends
    waiting: dict[tuple[Kind, int, int], int] = {}  # an F or B not ended yet -> the worker waiting for it
    # Events (time, worker): a worker is looked at when it becomes free or what it waits for arrives. A free
    # worker that cannot act has no W pending (an F held back by its limit leaves one), so only that arrival
    # can wake it.
    events = [(0, w) for w in range(n)]
    busy_until = [0] * n
    while events:
        t, w = heapq.heappop(events)
        if busy_until[w] > t:
            continue
        s = workers[w][0]
        act = None
        if pos[w] < len(fb[w]):
            a = fb[w][pos[w]]
            i = a.microbatch
            assert i is not None
            src = s - 1 if a.kind is Kind.F else s + 1
            dep = (a.kind, src, i)
            arrived = not 0 <= src < S or done.get(dep, t + 1) <= t
            if arrived and (a.kind is Kind.B or live[w] < limits[s]):
                act = a
                pos[w] += 1
                if a.kind is Kind.F:
                    live[w] += 1
                else:
                    pending[w].append(i)
                done[(a.kind, s, i)] = t + 1
                woken = waiting.pop((a.kind, s, i), None)
                if woken is not None:
                    heapq.heappush(events, (t + 1, woken))
            elif not arrived and not pending[w]:
                if dep in done:  # ends later: look again then
                    heapq.heappush(events, (done[dep], w))
                else:
                    waiting[dep] = w
        if act is None and pending[w]:
            act = Action(Kind.W, pending[w].popleft())
            live[w] -= 1
        if act is not None:
            out[w].append(act)
            busy_until[w] = t + 1
            heapq.heappush(events, (t + 1, w))
    if any(pos[w] < len(fb[w]) or pending[w] for w in range(n)):
        raise ScheduleError(f"zero-bubble replay stuck: m={m} replicas={list(replicas)} warm-ups {list(warmups)} "
                            f"limits {list(limits)}")
    return tuple(tuple(x) for x in out)
