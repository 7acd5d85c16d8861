"""`python -m partitioner.calibrate`: the runtime's own costs on this machine, read from a traced run (issue 13).

A profile times the layers alone; a rank under mpirun also spends time of its own on every action (Python
dispatch, the layers running slower in a stage than alone, the send of every activation and gradient: on CPU
gloo's send writes the socket from the calling thread). With small layers that is half of the step
(benchmarks/planner/README.md, "Accuracy"). Both are read from the Chrome trace of `pipeflow-train --trace`:

    message_ms = median duration of the SEND_F / SEND_B spans (the sender's time per message)
    action_ms  = median over ranks and steps of (own - n * profiled) / (2 n)

where a rank's `own` time in a step is its F, B and W spans plus the gaps between its spans (dispatch),
its WAIT, SEND and STEP spans excluded (and a replicated stage's last backward beyond its others: the
all-reduce runs beside it, priced below), n its forwards in the step, and `profiled` its stage's forward +
backward per microbatch as the planner counts them (with the profile's contention, price.contention_scale). With
replicas it also reads the all-reduce's bandwidth between ranks (on CPU gloo's over loopback):

    link_bandwidth = 2 (r-1)/r * P / (last B + STEP - optimizer step)   (bytes/s)

(the simulator starts the all-reduce with the last backward and ends it before the optimizer step). On a
pipeline under a flush schedule, what the run still took beyond the simulation with those costs (the
receiver's wait for a message past its send: gloo's I/O threads, scheduling, the step boundary's
agreement) is read as a latency per message:

    latency_ms = the value at which the simulated step time of the plan equals the traced one

(bisection; 0 when the simulation is already as slow); `step_gap_ms` is the mean time a rank spends between
two steps outside every span (the loss report of --log-every, the step loop). Several traced runs can be read
together (`--also PROFILE PLAN TRACE`, each on its own profile): a rank's own time per microbatch is then
fitted as

    own = compute_factor * profiled + 2 action_ms + 2 layer_ms * layers

with `compute_factor` where the same layers ran at two microbatch sizes (profiled work 1.5 x apart or more:
work that grows with the layers' time, slower kernels in a busy stage, told from a cost per action, which one
size alone cannot) and `layer_ms` where some ranks held 1.5 x the layers of others (a pipeline and data
parallelism: a cost per layer call, Python dispatch, told from a cost per action). From an async trace (an
update after every backward, no agreement in its STEP):

    update_ms = median of (STEP spans + the host's gaps right after them) / updates - profiled update

and without one, from the STEP spans of the other traces (one update a step; ranks without replicas, whose
STEP holds no all-reduce): per step the least any rank's STEP took beyond its profiled update (the optimizer step,
the non-finite check and the weight copies it makes keep: the rank that reached its STEP last waited there for
no other), the median over steps.

The first `--skip` steps (warm-up) are left out. The numbers go into profile.json as optional fields
(docs/formats.md, docs/calibration.md): the machine's and the runtime's, they serve the other models planned there."""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from partitioner.costmodel import PlanningError
from partitioner.inputs import check_optimizer
from partitioner.jsonfile import read_json
from partitioner.plan import Plan, PlanError
from partitioner.price import contention_scale
from partitioner.profile import Profile, ProfileError
from partitioner.service import evaluate_plan, layer_costs
from pipeflow.kinds import schedule_kind

OWN = ("F", "B", "W")
SENDS = ("SEND_F", "SEND_B")


def _spans(trace: Any) -> dict[int, dict[int, list[tuple[str, float, float]]]]:
    """rank -> step -> [(kind, start ms, end ms)] in time order, from the trace's complete events."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ProfileError("the trace must be a Chrome trace object with traceEvents (pipeflow-train --trace)")
    out: dict[int, dict[int, list[tuple[str, float, float]]]] = defaultdict(lambda: defaultdict(list))
    for e in trace["traceEvents"]:
        if isinstance(e, dict) and e.get("ph") == "X" and "step" in e.get("args", {}):
            kind = str(e["name"]).rstrip("0123456789")
            start = float(e["ts"]) / 1e3
            out[int(e["tid"])][int(e["args"]["step"])].append((kind, start, start + float(e["dur"]) / 1e3))
    for steps in out.values():
        for spans in steps.values():
            spans.sort(key=lambda s: s[1])
    return out


Run = tuple[Profile, Plan, Any]  # a traced run: the profile its plan was priced on, the plan, its Chrome trace
SPREAD = 1.5  # fit compute_factor only where the same layers' profiled work per microbatch differs this much


def calibrate(profile: Profile, plan: Plan, trace: Any, *, skip: int = 2, optimizer: str = "adam",
              also: Sequence[Run] = ()) -> dict[str, float]:
    """What the traced run of `plan` (and the runs `also`, priced on their own profiles) shows (module
    docstring): `action_ms`, `step_gap_ms`, `update_ms` where a rank stepped, `compute_factor` where the same
    layers ran at profiled work SPREAD x apart (two microbatch sizes), `message_ms` where ranks sent (a
    pipeline), `link_bandwidth` where a stage has replicas, `latency_ms` where a pipeline ran a flush schedule."""
    runs = [(profile, plan, trace), *also]
    # per run and rank: its layers, profiled ms per microbatch, median own ms per microbatch
    groups: list[tuple[tuple[int, int], float, float]] = []
    per_action: list[float] = []
    sends: list[float] = []
    reduce: list[float] = []  # bytes/s of the replicas' all-reduce, per rank and step
    gaps: list[float] = []  # ms between a rank's steps, outside every span
    per_update: list[float] = []  # ms an update takes beyond the profiled optimizer step (async traces)
    step_excess: dict[tuple[int, int], list[float]] = defaultdict(list)  # (run, step) -> per rank, other traces
    periods: list[tuple[Profile, Plan, float]] = []  # flush-schedule pipelines and their traced step time
    for run, (prof, pl, tr) in enumerate(runs):
        if pl.virtual_stages > 1:
            raise ProfileError(f"calibrate needs a plan with one stage per rank, found {pl.virtual_stages} chunks "
                               "per rank (interleaved): trace a plan without --virtual-stages")
        lay = layer_costs(replace(prof, compute_factor=None), pl.schedule, optimizer)  # as profiled
        busy = contention_scale(lay, evaluate_plan(replace(prof, compute_factor=None, contention=None), pl,
                                                   optimizer=optimizer).sim, pl.workers) if lay.contention > 1 else 1.0
        kind = schedule_kind(pl.schedule)
        L = len(lay)
        by_rank, sent = _spans(tr), len(sends)
        for rank, steps in by_rank.items():
            st = pl.stages[s := pl.stage_of_rank(rank)[0]]
            a, b = st.layers
            profiled = busy * (float(lay.forward_ms[a:b].sum() + lay.backward_ms[a:b].sum())
                               + (lay.loss_ms if b == L else 0.0))
            p = float(lay.params(a, b))  # a shared parameter once
            rate = lay.optimizer_ms_per_byte / (st.replicas if pl.shard_optimizer else 1)  # sharded: 1/r of it
            upd = p * (rate + lay.copy_ms_per_byte * kind.copies_per_update(pl.replicas, s))
            own_per_mb: list[float] = []
            for step, spans in steps.items():
                if step < skip:
                    continue
                n = sum(kind == "F" for kind, _, _ in spans)
                own = sum(end - start for kind, start, end in spans if kind in OWN)
                if st.replicas > 1:
                    own -= _reduce_overlap(spans)
                after = [(prev[0], max(0.0, nxt[1] - prev[2])) for prev, nxt in zip(spans, spans[1:])]
                own += sum(gap for kind, gap in after if kind != "STEP")  # a gap after an update is the update's
                sends += [end - start for kind, start, end in spans if kind in SENDS]
                if n:
                    per_action.append((own - n * profiled) / (2 * n))
                    own_per_mb.append(own / n)
                nxt_spans = steps.get(step + 1)
                if nxt_spans:
                    gaps.append(max(0.0, nxt_spans[0][1] - max(end for _, _, end in spans)))
                last_b = [end - start for kind, start, end in spans if kind == "B"][-1:]
                step_ms = sum(end - start for kind, start, end in spans if kind == "STEP")
                updates = sum(kind == "STEP" for kind, _, _ in spans)
                if kind.step_per_backward and st.replicas == 1 and updates:
                    # async: an update after every backward, no agreement in it; what it and the host's time
                    # right after it take beyond the profiled optimizer step
                    spent = step_ms + sum(gap for kind, gap in after if kind == "STEP")
                    per_update.append(spent / updates - upd)
                elif st.replicas == 1 and updates:
                    step_excess[(run, step)].append(step_ms / updates - upd)
                if st.replicas > 1 and p > 0 and last_b:
                    # The all-reduce starts with the last backward (reduce.py buckets it there) and ends inside
                    # STEP, before the optimizer step: the simulator's model, read backwards.
                    ms = last_b[0] + step_ms - upd
                    if ms > 0:
                        reduce.append(2 * (st.replicas - 1) / st.replicas * p / (ms / 1e3))
            if own_per_mb:
                groups.append(((a, b), profiled, statistics.median(own_per_mb)))
        period = _step_period_ms(by_rank, skip) if len(sends) > sent and kind.flush else None
        if period is not None:
            periods.append((prof, pl, period))
    if not per_action:
        raise ProfileError(f"the trace holds no forward after step {skip}: run pipeflow-train --trace for more "
                           "steps on this plan")
    out = _fit(groups) or {"action_ms": max(0.0, statistics.median(per_action))}
    # the mean: a cost paid every K steps (the loss report of --log-every K) is paid on average
    out["step_gap_ms"] = statistics.fmean(gaps) if gaps else 0.0
    if per_update:
        out["update_ms"] = max(0.0, statistics.median(per_update))
    elif step_excess:
        out["update_ms"] = max(0.0, statistics.median(min(v) for v in step_excess.values()))
    if sends:
        out["message_ms"] = statistics.median(sends)
    if reduce:
        out["link_bandwidth"] = statistics.median(reduce)
    if periods:  # with every other cost known: what the pipelines' step times leave, per message
        out["latency_ms"] = statistics.median(_latency_ms(prof, pl, out, period, optimizer)
                                              for prof, pl, period in periods)
    return out


def _reduce_overlap(spans: list[tuple[str, float, float]]) -> float:
    """A replicated rank's last backward beyond its others' median (the all-reduce beside it: link_bandwidth)."""
    bs = [end - start for kind, start, end in spans if kind == "B"]
    return max(0.0, bs[-1] - statistics.median(bs[:-1])) if len(bs) > 1 else 0.0


def _fit(groups: list[tuple[tuple[int, int], float, float]]) -> dict[str, float] | None:
    """A rank's own time per microbatch, own = compute_factor * profiled + 2 action_ms + 2 layer_ms * layers,
    least squares over the (rank, run) groups, with the terms the runs can tell apart (else None):
    `compute_factor` where the same layers were profiled at work SPREAD x apart (two microbatch sizes; one size
    cannot tell a factor from a constant), `layer_ms` where ranks held SPREAD x more layers than others (a
    pipeline and data parallelism: a cost per layer call, dispatch, from a cost per action). A term whose fit is
    negative is dropped and the rest fitted again."""
    by_layers: dict[tuple[int, int], list[float]] = defaultdict(list)
    for layers, x, _ in groups:
        by_layers[layers].append(x)
    counts = [b - a for (a, b), _, _ in groups]
    terms = {"compute_factor": any(min(xs) > 0 and max(xs) >= SPREAD * min(xs) for xs in by_layers.values()),
             "layer_ms": min(counts) > 0 and max(counts) >= SPREAD * min(counts), "action_ms": True}
    if not (terms["compute_factor"] or terms["layer_ms"]):
        return None
    xs = np.array([x for _, x, _ in groups])
    ys = np.array([y for _, _, y in groups])
    column = {"compute_factor": xs, "action_ms": np.full(len(xs), 2.0), "layer_ms": 2.0 * np.array(counts, float)}
    while True:
        names = [k for k, on in terms.items() if on]
        target = ys if terms["compute_factor"] else ys - xs  # without a factor the layers take their profile
        coef, *_ = np.linalg.lstsq(np.stack([column[k] for k in names], axis=1), target, rcond=None)
        fit = dict(zip(names, (float(c) for c in coef)))
        bad = [k for k in names if fit[k] < 0 or (k == "compute_factor" and fit[k] == 0)]
        if not bad:
            break
        terms[bad[0]] = False
        if not any(terms.values()):
            return None
    out = {"action_ms": fit.get("action_ms", 0.0)}
    out.update({k: fit[k] for k in ("compute_factor", "layer_ms") if k in fit})
    return out


def _step_period_ms(by_rank: dict[int, dict[int, list[tuple[str, float, float]]]], skip: int) -> float | None:
    """The traced run's step time: the median over ranks and steps of one step's first span to the next's."""
    periods = []
    for steps in by_rank.values():
        starts = sorted((step, spans[0][1]) for step, spans in steps.items() if step >= skip and spans)
        periods += [b - a for (k, a), (k2, b) in zip(starts, starts[1:]) if k2 == k + 1]
    return statistics.median(periods) if periods else None


def _latency_ms(profile: Profile, plan: Plan, found: dict[str, float], period_ms: float, optimizer: str) -> float:
    """The per-message latency at which the simulator, with the other calibrated costs, gives the traced
    run's step time (bisection: the simulated step time never decreases with it); 0 when it already does."""
    calibrated = profile.with_costs(found)

    def step_ms(latency: float) -> float:
        calibrated.latency_ms = latency
        return float(evaluate_plan(calibrated, plan, optimizer=optimizer).plan.predicted["step_ms"])

    lo, hi = 0.0, max(0.0, period_ms - step_ms(0.0))
    if hi == 0.0:
        return 0.0
    for _ in range(30):  # a message on the critical path: the simulated step grows with the latency
        if step_ms(hi) >= period_ms:
            break
        lo, hi = hi, 2 * hi
    else:
        return 0.0  # no message is on the critical path: latency explains nothing
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step_ms(mid) < period_ms else (lo, mid)
    return (lo + hi) / 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m partitioner.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="profile.json the plan was made from")
    p.add_argument("plan", help="plan.json that pipeflow-train ran")
    p.add_argument("trace", help="the Chrome trace that pipeflow-train --trace wrote")
    p.add_argument("--also", nargs=3, action="append", default=[], metavar=("PROFILE", "PLAN", "TRACE"),
                   help="another traced run on this machine (e.g. at another microbatch size, or data parallel), "
                        "read with the first: together they can tell compute_factor from action_ms")
    p.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up; default 2)")
    p.add_argument("--optimizer", help="the one pipeflow-train ran (default: the profile's if it timed one, else adam)")
    p.add_argument("-o", "--output", required=True, help="the first profile.json with the runtime's costs added")
    args = p.parse_args(argv)
    try:
        if args.skip < 0:
            raise ProfileError(f"--skip must be >= 0, found {args.skip}")
        runs = []
        for prof_path, plan_path, trace_path in [(args.profile, args.plan, args.trace), *args.also]:
            profile, plan = Profile.load(prof_path), Plan.load(plan_path)
            plan.validate(num_layers=len(profile.layers))
            runs.append((profile, plan, read_json(trace_path, "trace", ProfileError)))
        timed = sorted(runs[0][0].optimizer_ms_per_byte)  # what the run's update costs beyond it is read
        optimizer = args.optimizer or (timed[0] if len(timed) == 1 else "adam")
        for prof_path, (profile, _, _) in zip([args.profile, *(a[0] for a in args.also)], runs):
            check_optimizer(profile, optimizer, prof_path)  # else priced at 0, and its time read as the runtime's
        found = calibrate(*runs[0], skip=args.skip, also=runs[1:], optimizer=optimizer)
        runs[0][0].with_costs({k: round(v, 6) if k.endswith("_ms") or k == "compute_factor" else v
                                for k, v in found.items()}).save(args.output)
    except (ProfileError, PlanError, PlanningError, OSError) as e:
        print(f"calibrate: error: {e}", file=sys.stderr)
        return 2
    shown = {"layer_ms": "per layer {:.3f} ms", "compute_factor": "layers x {:.3f}", "message_ms":
             "per message sent {:.3f} ms", "link_bandwidth": "all-reduce {:.2f} GB/s", "latency_ms":
             "latency per message {:.3f} ms", "update_ms": "per update {:.3f} ms"}
    scaled = {k: v / 1e9 if k == "link_bandwidth" else v for k, v in found.items()}
    print(", ".join([f"runtime per action {found['action_ms']:.3f} ms"]
                    + [fmt.format(scaled[k]) for k, fmt in shown.items() if k in found]
                    + [f"between steps {found['step_gap_ms']:.3f} ms -> {args.output}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
