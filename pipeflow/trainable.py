"""Parameters frozen or unfrozen between the steps of your own loop (`requires_grad_`, as progressive unfreezing and
fine-tuning schedules do): the next `Pipeline.step` trains them as one process would.

What a rank builds from its trainable parameters is fixed when the Pipeline is built: the replicas' gradient buckets
(reduce.py), the parameters the global norm counts (clip.py), a stashed copy's `requires_grad` (stash.py), and
the metadata of the tensors crossing each stage boundary, sent once per input shape (comm.P2P), whose
`requires_grad` tells the receiver which gradients to send back. Left as built, an unfrozen parameter of a replicated
stage was never all-reduced (each replica stepped on its own gradient), the norm left it out, a frozen one stopped
the backward ("cannot register a hook"), and a stage frozen whole stopped the run with a shape error.

So every `Pipeline.step` given data compares this rank's `requires_grad` flags with the last step's, and the ranks
agree in one small all-gather whether any changed (the receiver of a boundary cannot know of its sender's change
otherwise); where one did, every rank builds those again before the step. Refused in one line on every rank: a
change on a stage whose optimizer state is sharded (its owners were chosen among the trainable parameters), and
under CUDA graphs once a step has run (the graphs replay the layers as captured). pipeflow-train, whose layers
nobody changes between steps, skips the all-gather.
"""
from __future__ import annotations

from typing import Any

from pipeflow.clip import grad_clip
from pipeflow.graphs import GraphedStage
from pipeflow.links import make_reducers
from pipeflow.stash import StashPolicy

CHANGED, SHARDED, GRAPHED = 1, 2, 4  # what a rank reports: it changed; and its optimizer is sharded; or graphed


def flags(engine: Any) -> tuple[bool, ...]:
    """This rank's requires_grad flags, in the engine's parameter order."""
    return tuple(p.requires_grad for p in engine.parameters())


def refusal(reports: list[int], stages: list[int]) -> str | None:
    """The error every rank raises alike for the ranks' `reports` (rank -> CHANGED | SHARDED | GRAPHED bits; `stages`:
    rank -> its stage), or None where the change can be followed."""
    sharded = [r for r, bits in enumerate(reports) if bits & CHANGED and bits & SHARDED]
    if sharded:
        return (f"Pipeline.step: requires_grad changed since the last step on rank {sharded[0]} (stage "
                f"{stages[sharded[0]]}), whose optimizer state is sharded over its replicas (shard_optimizer): each "
                "owns a share of the trainable parameters chosen when the Pipeline was built; freeze or unfreeze "
                "before building it, or build it without shard_optimizer")
    graphed = [r for r, bits in enumerate(reports) if bits & CHANGED and bits & GRAPHED]
    if graphed:
        return (f"Pipeline.step: requires_grad changed after the first step on rank {graphed[0]} (stage "
                f"{stages[graphed[0]]}), under PIPEFLOW_CUDA_GRAPHS=1, whose graphs replay the layers as the first "
                "step ran them; freeze or unfreeze before the first step")
    return None


class TrainableWatch:
    """Follows changes of the engine's requires_grad flags between steps (module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.flags = flags(engine)

    def check(self, steps_run: int) -> None:
        """Before a step (every rank, collective): build again what depends on the trainable parameters where any
        rank's changed since the last check; ValueError on every rank alike where that cannot be followed."""
        engine = self.engine
        now = flags(engine)
        bits = CHANGED if now != self.flags else 0
        if bits and engine.shard is not None:
            bits |= SHARDED
        if bits and steps_run and any(isinstance(c, GraphedStage) for c in engine.stages.values()):
            bits |= GRAPHED
        world = engine.world
        reports = world.mpi.allgather(bits) if world.size > 1 else [bits]
        if not any(reports):
            return
        stages = [engine.plan.stage_of_rank(r)[0] for r in range(world.size)]
        error = refusal(reports, stages)
        if error is not None:
            raise ValueError(error)
        rebuild(engine)
        self.flags = now


def rebuild(engine: Any) -> None:
    """What depends on the trainable parameters, built again between two steps, nothing in flight (every rank)."""
    update = engine.update
    update.settle()  # a postponed clipped update applied with the norm it was launched with
    engine.p2p.meta_cache.clear()  # every rank at once: each sender's next message sends its metadata again
    st = engine.plan.stages[engine.s]
    engine.tie_reducers, engine.reducers = make_reducers(engine.stages, engine.ties, engine.links, st.ranks,
                                                         engine.kind, engine.p2p, update.late)
    update.reducers = [*engine.reducers.values(), *engine.tie_reducers]
    if update.clip is not None:
        update.clip = grad_clip(update.clip.max_norm, engine.parameters(), engine.ties, engine.stages, st.replicas,
                                engine.r, engine.world, engine.kind)
    policy = engine.policy
    if isinstance(policy, StashPolicy):  # its free copies go to the next segment's policy (stash.segment_policy)
        for copy in [*policy.pool, *policy.copies.values()]:
            for q, (_, _, p) in zip(copy, policy.slots):
                q.requires_grad_(p.requires_grad)
