"""The Python API (pipeflow/api.py): a user's own loop over Pipeline.step equals single-process training
(float64), on -np 2 and on -np 3 with replicated stages, and under async/2bw equals pipeflow-train drained at
every step; its usage errors are one line."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeflow.api import BatchFeed, Pipeline
from tests import api_user_loop
from tests.conftest import Case, MpiRun, batched, in_background, run_mpi, write_plan

# (name, -np, schedule, plan stages as (layers, replicas) or None for Pipeline's even split, loss owner rank)
SETUPS = [("straight", 2, "1f1b", None, 1),
          ("first-replicated", 3, "gpipe", [(2, 2), (2, 1)], 2),
          ("last-replicated", 3, "1f1b", [(2, 1), (2, 2)], 1)]


def user_loop(d: Path, name: str) -> Case:
    _, np, schedule, stages, _ = next(s for s in SETUPS if s[0] == name)
    args = [str(d / "out"), schedule, "4"]
    if stages is not None:
        write_plan(d / "plan.json", schedule, 4, stages)
        args.append(str(d / "plan.json"))
    return Case(np, args, main="tests.api_user_loop:main")


def cli_and_loop(d: Path, schedule: str) -> list[Case]:
    """pipeflow-train, its asynchronous pipeline drained at every step (--checkpoint-every 1), and the same
    training written as a user loop over Pipeline.step (which drains every step)."""
    flags = ["--schedule", schedule, "--microbatches", "4", "--steps", "3"]
    return [Case(2, [*api_user_loop.CLI_ARGS, *flags, "--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "1",
                     "--save", str(d / "cli.pt")]),
            Case(2, [str(d / "loop"), schedule, "4", "3"], main="tests.api_user_loop:main_cli_data")]


@pytest.mark.parametrize("schedule", ["async", "2bw"])
@batched(cli_and_loop)
def test_pipeline_step_under_an_asynchronous_schedule_equals_pipeflow_train(mpi: MpiRun, schedule: str) -> None:
    cli = torch.load(mpi.dir / "cli.pt", weights_only=True)
    loop = torch.load(mpi.dir / "loop" / "model.pt", weights_only=True)
    assert cli.keys() == loop.keys()
    for k in cli:
        torch.testing.assert_close(loop[k], cli[k], rtol=0, atol=0, msg=f"{schedule}: {k}")


@pytest.mark.parametrize("name", [s[0] for s in SETUPS])
@batched(user_loop)
def test_user_loop_over_pipeline_step_equals_single_process_training(mpi: MpiRun, name: str) -> None:
    _, np, _, _, owner = next(s for s in SETUPS if s[0] == name)
    want, want_losses = api_user_loop.reference()
    got = torch.load(mpi.dir / "out" / "model.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=f"{name}: {k}")
    for rank in range(np):
        losses = json.loads((mpi.dir / "out" / f"losses-rank{rank}.json").read_text())
        if rank == owner:  # the minibatch's mean loss, as the single process computes it
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses))
        else:
            assert losses == [None] * api_user_loop.STEPS, f"rank {rank}"


def test_batch_feed_splits_a_minibatch_of_tuples_into_equal_microbatches() -> None:
    feed = BatchFeed(2)
    x = (torch.arange(8.0).reshape(4, 2), torch.arange(4))
    y = torch.tensor([0, 1, 2, 3])
    feed.set(3, x, y)  # step 3: global microbatches 6 and 7
    (x1, y1) = feed.microbatch(7)
    assert torch.equal(x1[0], x[0][2:]) and torch.equal(x1[1], x[1][2:]) and torch.equal(y1, y[2:])
    assert feed.signature(6) == ((2, 2), (2,))
    with pytest.raises(ValueError, match=r"^Pipeline.step: the minibatch must split into 2 microbatches of equal "
                                         r"size along dimension 0; found shapes \[\(3, 2\)\]$"):
        feed.set(0, torch.zeros(3, 2), None)
    with pytest.raises(ValueError, match=r"^Pipeline.step: target must be a tensor of 4 rows \(one per sample of "
                                         r"x\), found \(3,\)$"):
        feed.set(0, torch.zeros(4, 2), torch.zeros(3))


def test_pipeline_in_one_process_and_its_usage_errors() -> None:
    """A world of one (no mpirun): one stage; step needs the minibatch and its target."""
    want, want_losses = api_user_loop.reference()
    with Pipeline(api_user_loop.model(), F.cross_entropy, schedule="gpipe", microbatches=2, device="cpu",
                  optimizer=lambda p: torch.optim.SGD(p, lr=api_user_loop.LR)) as pipe:
        with pytest.raises(ValueError, match=r"^Pipeline.step needs the minibatch: step\(x, target=y\) on every "
                                             r"rank$"):
            pipe.step()
        with pytest.raises(ValueError, match=r"^Pipeline.step needs target= on the last stage's ranks"):
            pipe.step(torch.zeros(4, 4, dtype=torch.float64))
        losses = [pipe.step(x, target=y) for x, y in api_user_loop.batches()]
        got = pipe.state_dict()
    assert got is not None
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses))
    with pytest.raises(ValueError, match=r"^plan.schedule must be one of gpipe, 1f1b, async, 2bw, interleaved, zb, "
                                         r"zb-h2, found 'zigzag'$"):
        Pipeline(api_user_loop.model(), F.cross_entropy, schedule="zigzag", device="cpu",
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_the_engine_walks_its_modules_for_parameters_once_not_at_every_update(monkeypatch: pytest.MonkeyPatch) -> None:
    # async updates after every backward, and the non-finite check reads the rank's parameters at each update:
    # walking a stage of 14 GPT blocks for them took ~0.1 ms of host time an update. The engine keeps the list.
    from pipeflow.guard import StepGuard
    from pipeflow.stage import Stage

    calls: list[int] = []
    real = Stage.parameters
    monkeypatch.setattr(Stage, "parameters", lambda self: calls.append(1) or real(self))
    with Pipeline(api_user_loop.model(), F.cross_entropy, schedule="async", microbatches=2, device="cpu",
                  optimizer=lambda p: torch.optim.SGD(p, lr=api_user_loop.LR),
                  step_gate=lambda e: StepGuard(e, None, None, skip_nonfinite=False, agree_every_step=False)) as pipe:
        built = len(calls)
        for x, y in api_user_loop.batches():
            pipe.step(x, target=y)
        assert pipe.engine.step_gate is not None and pipe.engine.step_gate.step == 2 * len(api_user_loop.batches())
        assert len(calls) == built
        assert [id(p) for p in pipe.engine.parameters()] == [id(p) for p in pipe.engine.stage.module.parameters()]


def trainable_only(d: Path) -> Case:
    write_plan(d / "plan.json", "1f1b", 2, [(1, 1), (3, 1)])  # stage 0: the frozen first layer alone
    return Case(2, [str(d / "out"), str(d / "plan.json")], main="tests.api_user_loop:main_trainable_only")


@batched(trainable_only)
def test_an_optimizer_factory_failing_on_one_rank_fails_on_every_rank(mpi: MpiRun) -> None:
    """A factory over the parameters that need gradients, on a stage with none (fine-tuning): torch raised "empty
    parameter list" on that rank alone and the other waited for it forever. Every rank now raises the same one
    line, naming the rank, its stage and what it was given."""
    errors = [(mpi.dir / "out" / f"error-rank{r}.txt").read_text() for r in range(2)]
    assert errors[0] == errors[1] == (
        "the optimizer factory failed on rank 0 (stage 0): ValueError: optimizer got an empty parameter list (given 2 "
        "parameter(s), 0 needing gradients; a stage with nothing to train gets its frozen parameters or a frozen "
        "placeholder: make the optimizer over what it is given); `optimizer` makes a rank's optimizer from its "
        "stage's parameters, e.g. lambda ps: torch.optim.AdamW(ps, lr=1e-3)")


class _Gather:
    """An MPI communicator's allgather, the other ranks' values given."""

    def __init__(self, others: list[str | None]) -> None:
        self.others = others

    def allgather(self, mine: str | None) -> list[str | None]:
        return [mine, *self.others]


def test_optimizer_over_agrees_and_refuses_what_is_not_an_optimizer() -> None:
    from pipeflow.update import optimizer_over

    ps = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(optimizer_over(lambda p: torch.optim.SGD(p, lr=0.1), ps, torch.device("cpu"), _Gather([None])),
                      torch.optim.SGD)
    with pytest.raises(ValueError, match=r"^the optimizer factory failed on rank 1 \(stage 1\): boom; `optimizer`"):
        optimizer_over(lambda p: torch.optim.SGD(p, lr=0.1), ps, torch.device("cpu"), _Gather([" (stage 1): boom"]))
    with pytest.raises(ValueError, match=r"on rank 0: TypeError: it returned tuple, not a torch.optim.Optimizer"):
        optimizer_over(lambda p: (torch.optim.SGD(p, lr=0.1),), ps, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"on rank 0: TypeError: 'SGD' object is not callable"):
        optimizer_over(torch.optim.SGD(ps, lr=0.1), ps, torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"on rank 0: TypeError: LBFGS steps with a closure"):
        optimizer_over(lambda p: torch.optim.LBFGS(p), ps, torch.device("cpu"))


def clip_subset(d: Path) -> Case:
    return Case(2, [str(d / "out")], main="tests.api_user_loop:main_clip_subset")


@batched(clip_subset)
def test_clipping_scales_the_gradients_of_parameters_the_optimizer_leaves_out(mpi: MpiRun) -> None:
    """An optimizer over some of the trainable parameters: their gradients, never zeroed, add up from step to step and
    count in the norm, and clip_grad_norm_(model.parameters()) scales them too. pipeflow scaled only the optimizer's,
    so the norm grew faster than in one process (weights off by 5e-4 after 3 steps)."""
    got = torch.load(mpi.dir / "out" / "model.pt", weights_only=True)
    want = api_user_loop.clip_subset_reference()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14, msg=k)


@in_background
def test_an_error_on_one_rank_inside_a_step_ends_the_job() -> None:
    """The last stage's layer raises in the first step; the first stage, waiting for which gradients come back (MPI,
    once per signature: pipeflow/gradients.py), waited forever. The job now ends there, the error and its traceback
    on stderr, as `python -m mpi4py` ends it."""
    t0 = time.monotonic()
    proc = run_mpi(2, [], module="tests.api_failing_layer", timeout=120, check=False)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60, proc.stderr
    assert ("pipeflow: rank 1: RuntimeError: the layer's own bug (its peers cannot go on without it: the job ends)"
            in proc.stderr), proc.stderr
    assert "Traceback" in proc.stderr  # where it came from
