"""A deferred update (pipeflow/update.py: 2bw's last stage and data parallelism) applies each gradient one STEP
late with its own gate outcome: the weights are those of updating at once, a STEP later, bit for bit."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

from pipeflow.guard import StepGuard
from pipeflow.signals import SignalStop
from pipeflow.update import Update

GRADS = [1.0, float("nan"), -2.0, 0.5, 3.0, 1.5]  # the second update is non-finite: skipped (--skip-nonfinite)
LOSSES = [0.5, 0.5, 0.5, 0.5, float("inf"), 0.5]  # the fifth minibatch's loss too, with a finite gradient


class TwoReplicas:
    """A stand-in for reduce.GradReducer over two replicas holding the same gradient: the sum doubles it. It
    records when each gradient is reduced (launched) and given back (completed)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params, self.events = params, []

    def launch(self) -> list:
        self.events.append("launch")
        return [(p, p.grad) for p in self.params]

    def complete(self, red: list) -> None:
        self.events.append("complete")
        for p, g in red:
            p.grad = None if g is None else g * 2

    def finish(self) -> None:
        self.complete(self.launch())


def _run(*, deferred: bool, lagged: bool, late: bool = False) -> tuple[list[torch.Tensor], torch.Tensor, list[int],
                                                                        dict, list[str]]:
    """The weights after each STEP and after the drain, the updates the guard skipped, Adam's state, the
    reducer's events."""
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    frozen = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))  # outside the optimizer (a shard's others)
    opt = torch.optim.Adam([w], lr=0.1, fused=True)
    stage = SimpleNamespace(parameters=lambda: [w, frozen], last=True)
    engine = SimpleNamespace(S=1, s=0, actions=[], optimizer=opt, stage=stage, losses=[],
                             world=SimpleNamespace(device=torch.device("cpu")), parameters=stage.parameters,
                             holds_last=True)
    guard = StepGuard(engine, MPI.COMM_SELF, SignalStop(), skip_nonfinite=True, agree_every_step=False)
    guard.lagged = lagged  # a CUDA rank's fused optimizer skips on the device, armed by the gate's flag
    reducer = TwoReplicas([w, frozen])
    update = engine.update = Update(opt, [w, frozen], None, [reducer], deferred=deferred, late=late,
                                    broadcast_overlaps=False)
    after = []
    for g, loss in zip(GRADS, LOSSES):
        w.grad = torch.full((3,), g, dtype=torch.float64)
        frozen.grad = torch.ones(2, dtype=torch.float64)
        engine.losses = [torch.tensor(loss, dtype=torch.float64)]  # the minibatch's: the last stage's loss
        update.reduce()
        update.step(guard, engine.losses)
        assert w.grad is None  # nothing left for the next minibatch to add to
        assert (frozen.grad is None) == deferred  # held: only the optimizer's (a shard drops the others itself)
        after.append(w.detach().clone())
    engine.losses = []  # read by a report (Engine.take_loss) before the segment's end
    update.drain(guard)
    guard.flush_pending()
    return (after, w.detach().clone(), guard.skipped, {k: v.clone() for k, v in opt.state[w].items()},
            reducer.events)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("lagged", [False, True])
def test_a_deferred_update_is_the_same_update_a_step_late(lagged: bool, late: bool) -> None:
    """`late`: the all-reduce of each gradient completes at the next STEP, where the gate decides on it with its
    minibatch's losses (a non-finite loss skips that update, not the next)."""
    at_once, final_at_once, skipped_at_once, state_at_once, _ = _run(deferred=False, lagged=lagged)
    late_w, final_late, skipped_late, state_late, events = _run(deferred=True, lagged=lagged, late=late)
    assert torch.equal(late_w[0], torch.ones(3, dtype=torch.float64))  # the first STEP applies nothing
    for k in range(1, len(GRADS)):
        assert torch.equal(late_w[k], at_once[k - 1]), k  # STEP k applies minibatch k - 1's gradient
    assert torch.equal(final_late, final_at_once)  # the drain applies the last one
    assert skipped_late == skipped_at_once == [1, 4]  # the non-finite updates, and only they, skipped in both
    assert state_late.keys() == state_at_once.keys()
    assert all(torch.equal(state_late[k], state_at_once[k]) for k in state_at_once)
    assert torch.equal(at_once[1], at_once[0])  # the skip left the weights as they were
    # Late: each STEP launches its gradient's all-reduce and completes the one before it (the drain the last).
    assert events == (["launch"] + ["launch", "complete"] * (len(GRADS) - 1) + ["complete"] if late
                      else ["launch", "complete"] * len(GRADS))


def test_which_workers_defer_their_updates() -> None:
    """stash.defers_update: 2bw's data parallelism and its last stage (every forward's backward before the next
    STEP, on the updates applied by then); not its other stages, not a last stage warmed up deeper (its forwards
    run ahead of the minibatch's end), not async (each microbatch on the newest version)."""
    from pipeflow.schedule import generate
    from pipeflow.stash import defers_update, version_fn

    def deferring(name: str, stages: int, replicas: list[int], m: int, warmup: list[int] | None = None) -> list[bool]:
        sched = generate(name, stages, 4 * m, replicas, minibatch=m, warmup=warmup)
        return [defers_update(sched.actions[w], version_fn(sched, sched.stage_of(w), minibatch=m))
                for w in range(len(sched.actions))]

    assert deferring("2bw", 1, [2], 4) == [True, True]
    assert deferring("2bw", 3, [1, 1, 1], 4) == [False, False, True]
    assert deferring("2bw", 2, [1, 2], 4) == [False, True, True]
    assert deferring("2bw", 2, [1, 1], 4, warmup=[1, 1]) == [False, False]
    assert deferring("async", 1, [2], 4) == [False, False]
    assert deferring("async", 2, [1, 1], 4) == [False, False]
