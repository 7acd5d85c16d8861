"""The process groups one rank's engine needs, set up in the same order on every rank: a point-to-point
channel per direction of every stage boundary (chunk k to chunk k+1, the last rank group wrapping to the
first under interleaved plans), a group per replicated rank group, and one per rank set holding a tied
parameter (Megatron's embedding group)."""
from __future__ import annotations

import logging
import os
import socket
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from partitioner.plan import Plan
from pipeflow.actions import Action, Kind, Schedule
from pipeflow.celink import PairSum
from pipeflow.cesetup import reduce_transport
from pipeflow.comm import P2P, World, nccl_p2p_options, new_group, new_groups
from pipeflow.kinds import ScheduleKind
from pipeflow.reduce import GradReducer, Tie
from pipeflow.stage import Stage
from pipeflow.tensorops import LARGE
from pipeflow.turns import Turns

log = logging.getLogger(__name__)


@dataclass
class Links:
    p2p: dict[tuple[int, int, str], Any]  # (sender, receiver, "F" | "B") -> its group (or Turns of groups)
    replica_groups: dict[tuple[int, ...], Any]  # a replicated group's ranks -> its group
    loss_group: Any  # the last stage's replicas (they sum the loss), or None
    tie_groups: dict[tuple[int, ...], Any]  # ranks holding a tied parameter -> their group
    # (sender, receiver, "R") both ways for each stage's two replicas under PIPEFLOW_REDUCE=ce (celink.PairSum)
    reduce_keys: list[tuple[int, int, str]]


def make_links(world: World, plan: Plan, ties: list[Tie]) -> Links:
    """Groups for every neighbouring pair of stages (both directions), every replicated rank group, and
    every tie's rank set, created in the same order on all ranks."""
    pairs: list[tuple[int, int, str]] = []
    for k in range(len(plan.stages) - 1):
        for a in plan.stages[k].ranks:
            for b in plan.stages[k + 1].ranks:
                # Interleaved plans cross the same pair once per chunk: one channel carries them all.
                pairs += [p for p in ((a, b, "F"), (b, a, "B")) if p not in pairs]
    # Two groups per pair: one per direction (see comm.P2P), so create each rank set twice (or 2n times with
    # n groups per channel taken in turn, gloo_turns).
    groups: dict[tuple[int, int, str], Any] = {}
    options = p2p_group_options(world.backend, world.group_timeout_s)
    turns = gloo_turns(world)
    for a, b, d in pairs:
        if world.size == 1:
            groups[(a, b, d)] = None
        else:
            channel = [new_group(sorted((a, b)), options, timeout_s=world.group_timeout_s) for _ in range(turns)]
            groups[(a, b, d)] = channel[0] if turns == 1 else Turns(channel)
    rank_groups = plan.stages[:plan.groups]
    replica_groups = new_groups(world, [st.ranks for st in rank_groups if st.replicas > 1])
    last = plan.stages[-1]
    loss_group = replica_groups.get(tuple(last.ranks)) if last.replicas > 1 else None
    # Tied parameters: one group per rank set holding one, after the others.
    tie_groups = new_groups(world, [t.ranks for t in ties])
    pairs2 = [st.ranks for st in rank_groups if st.replicas == 2] if reduce_transport() == "ce" else []
    return Links(groups, replica_groups, loss_group, tie_groups, [(a, b, "R") for x, y in pairs2
                                                                   for a, b in ((x, y), (y, x))])


def pair_sum(p2p: P2P, ranks: list[int]) -> PairSum | None:
    """The sum over a stage's two replicas `ranks` on the copy engines, where warm_up set up both channels."""
    me = p2p.world.rank
    peer = next((r for r in ranks if r != me), me)
    keys = ((me, peer, "R"), (peer, me, "R"))
    if p2p.ce is None or len(ranks) != 2 or not all(p2p.ce.has(k) for k in keys):
        return None
    log.info("the replicas' gradients summed on the copy engines with rank %d at the STEP (PIPEFLOW_REDUCE=ce)", peer)
    return PairSum(p2p.ce, me, peer)


GLOO_GROUPS = ("auto", "1", "2")


def gloo_groups(environ: Mapping[str, str] = os.environ) -> str:
    """PIPEFLOW_GLOO_GROUPS: process groups per point-to-point channel under gloo (auto, 1 or 2)."""
    text = environ.get("PIPEFLOW_GLOO_GROUPS", "auto")
    if text not in GLOO_GROUPS:
        raise ValueError(f"PIPEFLOW_GLOO_GROUPS must be one of {', '.join(GLOO_GROUPS)}, found {text!r}")
    return text


def gloo_turns(world: World) -> int:
    """Process groups per point-to-point channel, taken in turn: under gloo, PIPEFLOW_GLOO_GROUPS as rank 0 reads
    it, where `auto` (the default) is 2 where every host has a core for each of its ranks (by CPU affinity),
    else 1; the same answer on every rank, all reading one allgather. Posting a gloo receive waits while the
    peer's previous send on that group is in flight: 3-6 ms about once a step on the 2-core test machine, the
    host idle meanwhile. Alternate messages on two groups never wait behind each other (2 ranks: 8-20% more
    samples/s), but each group starts its own gloo threads, which cost more than the waits where ranks
    outnumber cores (4 ranks on 2 cores: 10-15% fewer; benchmarks/planner/README.md)."""
    if world.backend != "gloo" or world.size == 1:
        return 1
    hosts = world.mpi.allgather((socket.gethostname(), len(os.sched_getaffinity(0)), gloo_groups()))
    ranks = Counter(host for host, _, _ in hosts)
    cores = {host: n for host, n, _ in hosts}
    if hosts[0][2] != "auto":
        turns, why = int(hosts[0][2]), f"PIPEFLOW_GLOO_GROUPS={hosts[0][2]}"
    else:
        turns = 2 if all(ranks[host] <= n for host, n in cores.items()) else 1
        why = "PIPEFLOW_GLOO_GROUPS=auto; " + ", ".join(f"{h}: {ranks[h]} ranks on {n} cores" for h, n in cores.items())
    log.info("gloo: %d process group(s) per point-to-point channel (%s)", turns, why)
    return turns


def send_window(sched: Schedule) -> int:
    """Sends a rank may keep before it waits for its oldest (comm.P2P), from M, the most microbatches
    any worker holds between F and B, and R, the most replicas: among 3(M + R) + 2 later sends, at least
    M + R are gradients or follow backwards, so the peers have gone past the oldest one's receive
    (they run F and B in microbatch order, at most M ahead). Under 1f1b M <= stages, whatever m.
    With several chunks per rank that order is not the microbatch order: keep every send of the list."""
    if sched.virtual_stages > 1:
        return max(sum(a.kind.is_send for a in acts) for acts in sched.actions) + 1
    most = 0
    for acts in sched.actions:
        held = 0
        for a in acts:
            held += (a.kind is Kind.F) - (a.kind is Kind.B)
            most = max(most, held)
    return 3 * (most + max(sched.replicas)) + 2


def arm_points(sched: Schedule, worker: int, actions: list[Action], kind: Kind = Kind.B) -> set[tuple[int, int]]:
    """(stage, microbatch) of each chunk's last backward (`kind` B, or W where the backward is split) before a
    STEP: its replicas' reducer is armed there (reduce.GradReducer), its gradients being final after it."""
    last: dict[int, tuple[int, int]] = {}
    out: set[tuple[int, int]] = set()
    for a in actions:
        if a.kind is kind and a.microbatch is not None:
            k = sched.stage_at(worker, a)
            last[k] = (k, a.microbatch)
        elif a.kind is Kind.STEP:
            out.update(last.values())
            last.clear()
    return out


def tied_here(ties: list[Tie], stages: list[Stage]) -> list[tuple[Tie, torch.nn.Parameter]]:
    """The ties this rank holds, each with its parameter as this rank's modules hold it (chunks of one rank
    share a tied Parameter object: Module.to converts parameters in place)."""
    out = []
    for t in ties:
        for stage in stages:
            start, end = stage.start, stage.start + len(stage.module)
            here = [(i, n) for i, n in t.uses if start <= i < end]
            if here:
                i, name = here[0]
                out.append((t, stage.module[i - start].get_parameter(name)))
                break
    return out


def tie_groups(ties: list[Tie], stages: list[Stage], groups: dict[tuple[int, ...], Any]
               ) -> list[tuple[list[torch.nn.Parameter], Any]]:
    """(this rank's tied parameters, group) per tie rank set this rank is in, in the same order on
    every rank, so that the all-reduces of Engine._step are issued in one global order."""
    by_ranks: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for t, p in tied_here(ties, stages):
        by_ranks.setdefault(tuple(t.ranks), []).append(p)
    # A tie whose stages all sit on this one rank is one Parameter here: nothing to sum.
    return [(params, groups[ranks]) for ranks, params in by_ranks.items() if len(ranks) > 1]


def tied_async_error(ties: list[Tie], schedule: str) -> str:
    """One line: why a tied parameter across stages cannot train under an asynchronous schedule."""
    t = ties[0]
    return (f"parameter {' = '.join(t.keys)} is shared by stages {', '.join(map(str, t.stages))}, which --schedule "
            f"{schedule} cannot train: its stages use different weight versions of one parameter. Use --schedule "
            "gpipe or 1f1b, or a plan that keeps the tied layers on one stage")


def make_reducers(stages: dict[int, Stage], ties: list[Tie], links: Links, ranks: list[int], kind: ScheduleKind,
                  p2p: P2P, late: bool = False) -> tuple[list[GradReducer], dict[int, GradReducer]]:
    """The gradient reducers of a rank's chunks: one per tie rank set it is in (summing a tied parameter's
    gradient over its uses), and with replicas one per chunk over the replica group, tied parameters apart.
    `late` (a deferred update's all-reduce under the next minibatch, update.py): none started during a backward;
    nor with two replicas summing on the copy engines (PIPEFLOW_REDUCE=ce, pair_sum): from the main thread."""
    chunks = list(stages.values())
    tied = {id(p) for _, p in tied_here(ties, chunks)}
    tie_reducers = [GradReducer(params, group, overlap=False) for params, group in tie_groups(ties, chunks,
                                                                                              links.tie_groups)]
    if len(ranks) == 1:
        return tie_reducers, {}
    group = links.replica_groups[tuple(ranks)]
    # async: PipeDream's replicas are DDP, an update takes the mean of their r gradients; flush schedules
    # scale each microbatch's loss by 1/m, so the sum is already the minibatch mean. Several chunks: each
    # reduces in finish(), in chunk order, the same on every replica.
    exchange = pair_sum(p2p, ranks)
    return tie_reducers, {k: GradReducer([p for p in c.parameters() if id(p) not in tied], group,
                                         average=kind.mean_over_replicas,
                                         overlap=len(chunks) == 1 and not late and exchange is None,
                                         large=inplace_elements(), exchange=exchange)
                          for k, c in stages.items()}


def p2p_max_ctas(environ: Mapping[str, str] = os.environ) -> int:
    """PIPEFLOW_P2P_MAX_CTAS as an integer >= 0 (0: NCCL's own choice); default 4."""
    text = environ.get("PIPEFLOW_P2P_MAX_CTAS", "4")
    try:
        ctas = int(text)
    except ValueError:
        ctas = -1
    if ctas < 0:
        raise ValueError(f"PIPEFLOW_P2P_MAX_CTAS must be an integer >= 0 (CTAs per NCCL point-to-point channel; "
                         f"0: NCCL's choice), found {text!r}")
    return ctas


def inplace_elements(environ: Mapping[str, str] = os.environ) -> int:
    """PIPEFLOW_REDUCE_INPLACE: gradients of at least this many elements are all-reduced in place, the smaller
    ones in flat buckets (reduce.GradReducer); default 2^20, as tensorops.LARGE."""
    text = environ.get("PIPEFLOW_REDUCE_INPLACE", str(LARGE))
    n = int(text) if text.isdigit() else 0
    if n < 1:
        raise ValueError(f"PIPEFLOW_REDUCE_INPLACE must be an integer >= 1 (elements from which a gradient is "
                         f"all-reduced in place), found {text!r}")
    return n


def reduce_late(environ: Mapping[str, str] = os.environ) -> bool:
    """PIPEFLOW_REDUCE_LATE: 1 (default), a deferred update's all-reduce runs under the next minibatch (update.py);
    0, beside the last backward as elsewhere."""
    text = environ.get("PIPEFLOW_REDUCE_LATE", "1")
    if text not in ("0", "1"):
        raise ValueError(f"PIPEFLOW_REDUCE_LATE must be 1 (a deferred update's all-reduce under the next minibatch) "
                         f"or 0 (beside the last backward), found {text!r}")
    return text == "1"


def p2p_group_options(backend: str, timeout_s: float) -> Any:
    """NCCL options for the point-to-point channels: a posted receive occupies its CTAs on the GPU
    until the peer's send arrives, so each channel gets few (PIPEFLOW_P2P_MAX_CTAS, default 4) to
    leave the SMs to compute; a high-priority stream lets transfers jump the compute queue."""
    if backend != "nccl":
        return None
    return nccl_p2p_options(p2p_max_ctas(), timeout_s)
