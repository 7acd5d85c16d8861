"""Forward-only evaluation through the pipeline: one minibatch's mean loss, no gradients, no update (Pipeline.evaluate,
pipeflow-train --eval-every; DeepSpeed's PipelineEngine.eval_batch).

It does not go through the training action lists. Each rank takes the minibatch's microbatches in order and, for
each, every chunk it holds in model order (one, unless the plan interleaves): receive the chunk's input from the rank
of the previous model stage, run the layers, send the output on, or take the loss on the last stage. Replica q of a
stage with r replicas runs the microbatches i = q (mod r), as training does. Every rank takes its items in the same
order, (microbatch, model stage), and an item waits only for the one before it on the previous stage: so the
smallest unfinished item can always run, and sends, which wait only for older sends to be received, cannot deadlock.

Every layer runs in eval mode (`model.eval()` in one process: dropout off, BatchNorm on its running statistics, which
it leaves alone) under torch.no_grad, and is put back in the mode it had, module by module. The messages travel on
the training channels' forward direction (comm.P2P), which nothing of training uses between steps: at a step's (or
an asynchronous segment's) end every training message has been received and every send waited for. Their shapes are
cached under signatures of their own, ("eval", sender stage, input shapes): an evaluation's outputs need no
gradient and may have other shapes, so they must not meet training's cached shapes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeflow.hooks import Feed
from pipeflow.lossmean import mean_loss

if TYPE_CHECKING:
    from pipeflow.engine import Engine


@contextlib.contextmanager
def eval_mode(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Every module in eval mode (through .eval(), as model.eval() does), then each submodule back in the mode it
    had: one the user froze in eval mode stays so, the others train again."""
    mods = list(modules)
    was = [(sub, sub.training) for mod in mods for sub in mod.modules()]
    for mod in mods:
        mod.eval()
    try:
        yield
    finally:
        for sub, training in was:
            sub.training = training  # not .train(): it would reset the children too


def evaluate(engine: Engine, data: Feed, first: int) -> float | None:
    """The mean loss of microbatches first .. first + m - 1 of `data` on the rank that owns the loss (the last stage's
    first replica), None elsewhere. Collective: every rank calls it at the same point, between training steps."""
    plan, p2p, me = engine.plan, engine.p2p, engine.world.rank

    def rank_of(k: int, i: int) -> int:  # the replica of model stage k that runs microbatch i (1F1B-RR)
        st = plan.stages[k]
        return st.ranks[i % st.replicas]

    losses: list[torch.Tensor] = []
    with eval_mode(c.module for c in engine.stages.values()), torch.no_grad():
        for i in range(engine.m):
            j = first + i
            shapes = data.signature(j)
            for k in sorted(engine.stages):
                if rank_of(k, i) != me:
                    continue
                stage = engine.stages[k]
                bufs: list[torch.Tensor] = []
                if stage.first:
                    x, y = data.microbatch(j)
                    outs, tree = stage.evaluate(j, x, y)
                else:
                    src, signature = rank_of(k - 1, i), ("eval", k - 1, shapes)
                    bufs, works = p2p.recv(src, "F", signature=signature)
                    for w in works:
                        w.wait()
                    y = data.microbatch(j)[1] if stage.last else None
                    outs, tree = stage.evaluate(j, bufs, y, tree=p2p.expect_meta(src, signature)[1])
                if stage.last:
                    losses.append(outs[0])
                else:
                    p2p.send(outs, rank_of(k + 1, i), "F", signature=("eval", k, shapes), tree=tree)
                p2p.release(bufs, keep=outs)  # a buffer an output passed through stays out of the pool
    p2p.wait_sends()  # nothing of the evaluation left in flight when training goes on
    if not engine.holds_last:
        return None
    return mean_loss(losses, engine.m, engine.loss_group, engine.world.device, owner=engine.owns_loss)
