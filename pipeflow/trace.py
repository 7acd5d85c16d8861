"""The Chrome trace of a run: the ranks' clocks lined up, their spans as events, a resumed run appended."""
from __future__ import annotations

import json
import logging
import math
import socket
import time
from typing import Any

from pipeflow.spans import CATEGORY, Span

log = logging.getLogger("pipeflow.monitor")  # the name these lines had before monitor.py was split


def clock_offset(comm: Any, rounds: int = 32) -> float:
    """This rank's perf_counter minus rank 0's. Ranks of one host share the clock (CLOCK_MONOTONIC): 0 apart.
    Each other host's first rank is measured by Cristian's algorithm (rank 0 asks for its clock; the round trip
    with the least delay gives the estimate) and its host follows. A barrier alone leaves ranks milliseconds
    apart when they share cores."""
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    leader = {h: hosts.index(h) for h in hosts}
    offsets = [0.0] * size
    for r in sorted(set(leader.values()) - {leader[hosts[0]]}):
        best = math.inf
        for _ in range(rounds):
            if rank == 0:
                t1 = time.perf_counter()
                comm.send(None, dest=r, tag=1)
                tr = comm.recv(source=r, tag=2)
                t2 = time.perf_counter()
                if t2 - t1 < best:
                    best, offsets[r] = t2 - t1, tr - (t1 + t2) / 2
            elif rank == r:
                comm.recv(source=0, tag=1)
                comm.send(time.perf_counter(), dest=0, tag=2)
    offsets = [offsets[leader[h]] for h in hosts]
    return float(comm.scatter(offsets, root=0))


def chrome_trace(ranks: list[tuple[int, int, list[Span]]], *, title: str = "pipeflow") -> dict[str, Any]:
    """Chrome trace events (Perfetto, chrome://tracing): one process, one row (tid) per rank, a complete
    ("X") event per span named like the schedule's actions (F3, B3, SEND_F3, STEP)."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}]
    for rank, stage, spans in sorted(ranks, key=lambda r: r[0]):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank} (stage {stage})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}})
        for s in spans:
            args: dict[str, Any] = {"step": s.step}
            if s.mb is not None:
                args["microbatch"] = s.mb
            events.append({"name": s.kind if s.mb is None else f"{s.kind}{s.mb}", "cat": CATEGORY.get(s.kind, "other"),
                           "ph": "X", "pid": 0, "tid": rank, "ts": round(s.start * 1e6, 3),
                           "dur": round((s.end - s.start) * 1e6, 3), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def append_trace(path: str, new: dict[str, Any], first_step: int) -> dict[str, Any]:
    """The trace at `path` (a run this one resumed) followed by `new`: the first run's spans of steps before
    `first_step` (later ones are trained again), then this run's as another process (pid) shifted to start
    after them. A missing or foreign file gives `new` alone."""
    try:
        with open(path) as f:
            old = json.load(f)
        events = old["traceEvents"]
        if not isinstance(events, list) or not all(isinstance(ev, dict) for ev in events):
            raise TypeError("traceEvents is not a list of objects")
    except FileNotFoundError:
        return new
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("--trace %s: not a trace this run can append to (%s); writing this run's alone", path, e)
        return new
    kept = [e for e in events if e.get("ph") != "X" or e.get("args", {}).get("step", 0) < first_step]
    end = max((e["ts"] + e.get("dur", 0) for e in kept if e.get("ph") == "X"), default=0.0)
    pid = 1 + max((e.get("pid", 0) for e in kept), default=0)
    shift = end + 1000.0  # µs: a visible gap between the runs
    out = []
    for ev in new["traceEvents"]:
        ev = {**ev, "pid": pid}
        if "ts" in ev:
            ev["ts"] = round(ev["ts"] + shift, 3)
        out.append(ev)
    return {**new, "traceEvents": kept + out}
