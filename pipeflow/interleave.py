"""Megatron's interleaved 1F1B: the compute order of a rank group holding several model chunks (pure)."""
from __future__ import annotations

from collections.abc import Sequence

from pipeflow.actions import STEP, Action, Kind
from pipeflow.warmup import warmup_forwards


def interleave_round(replicas: Sequence[int]) -> int:
    """Global microbatches in one round of the interleaved schedule: S, times the most replicas of a group
    (every replica then has a share of each round; a dry run over S, v, m and replicas finds no deadlock)."""
    return len(replicas) * max(replicas)


def interleaved_order(mbs: list[int], microbatches: int, replicas: Sequence[int], group: int,
                 virtual: int) -> list[Action]:
    """Megatron's interleaved 1F1B (Narayanan et al., SC'21 §2.2): microbatches go in rounds of S (the rank
    groups); a round runs chunk 0 of its microbatches, then chunk 1, ... (backwards: the last chunk
    first). Warm-up: (v-1)*S + 2*(S-1-group) forwards, then one forward and one backward in turn.

    With replicas, a round is interleave_round(replicas) consecutive global microbatches, the same on every group,
    so that both ends of a channel order its messages alike (each worker runs its share of each round);
    the warm-up counts this worker's share of a round and PipeDream's NOAM depth instead of S-1-group."""
    S = len(replicas)
    size = interleave_round(replicas)
    rounds = [[i for i in mbs if i // size == k] for k in sorted({i // size for i in mbs})]
    chunks = [group + c * S for c in range(virtual)]  # the model stages this group holds
    forwards = [(k, i) for rnd in rounds for k in chunks for i in rnd]
    backwards = [(k, i) for rnd in rounds for k in reversed(chunks) for i in rnd]
    share = len(rounds[0]) if rounds else 0
    warmup = min(len(forwards), (virtual - 1) * share + 2 * warmup_forwards(replicas, group))
    order = [Action(Kind.F, i, k) for k, i in forwards[:warmup]]
    for (fk, fi), (bk, bi) in zip(forwards[warmup:], backwards):
        order += [Action(Kind.F, fi, fk), Action(Kind.B, bi, bk)]
    order += [Action(Kind.B, i, k) for k, i in backwards[len(forwards) - warmup:]]
    return order + [STEP]
