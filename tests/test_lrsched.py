"""The learning-rate schedule (pipeflow/lrsched.py: --lr-warmup, --lr-decay, --min-lr, --lr-decay-steps): the formula
against hand-computed values and torch's LambdaLR; pipelined runs under every kind of update (flush, 2bw's deferred,
postponed and late updates, async's per-microbatch updates, a resume) equal to one process setting the lr of each
update; the bad values refused in one line; the lr shown in TensorBoard and the loss lines."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import pipeflow
from pipeflow import config
from pipeflow.lrsched import LrSchedule, ScheduledLr, lr_at, scheduled_lr
from pipeflow.train import build_parser, check_args
from pipeflow.update import Update
from tests.conftest import Case, MpiRun, batched, write_plan
from tests.reference import reference_delayed, reference_flush, warmup_decay

# ---------------------------------------------------------------- the formula

COS = 0.5 * (1 + math.cos(math.pi / 4))  # cosine's coefficient a quarter of the way through the decay


@pytest.mark.parametrize("u,kw,want", [
    # warm-up lr (u + 1) / (N + 1), then the peak (no decay)
    (0, {"warmup": 4}, 0.2), (3, {"warmup": 4}, 0.8), (4, {"warmup": 4}, 1.0), (1000, {"warmup": 4}, 1.0),
    # cosine from lr at N = 2 to min_lr 0.1 at K = 6, min_lr after
    (1, {"warmup": 2, "decay": "cosine", "min_lr": 0.1, "decay_steps": 6}, 2 / 3),
    (2, {"warmup": 2, "decay": "cosine", "min_lr": 0.1, "decay_steps": 6}, 1.0),
    (3, {"warmup": 2, "decay": "cosine", "min_lr": 0.1, "decay_steps": 6}, 0.1 + COS * 0.9),
    (4, {"warmup": 2, "decay": "cosine", "min_lr": 0.1, "decay_steps": 6}, 0.55),
    (6, {"warmup": 2, "decay": "cosine", "min_lr": 0.1, "decay_steps": 6}, 0.1),  # K reached: the floor exactly
    (9, {"warmup": 2, "decay": "cosine", "min_lr": 0.1, "decay_steps": 6}, 0.1),
    # linear, same ends
    (3, {"warmup": 2, "decay": "linear", "min_lr": 0.1, "decay_steps": 6}, 0.775),
    (5, {"warmup": 2, "decay": "linear", "min_lr": 0.1, "decay_steps": 6}, 0.325),
    (6, {"warmup": 2, "decay": "linear", "min_lr": 0.1, "decay_steps": 6}, 0.1),
    (50, {"warmup": 2, "decay": "linear", "min_lr": 0.1, "decay_steps": 6}, 0.1),
    # N = 0: the decay starts at the peak on the first update
    (0, {"decay": "cosine", "decay_steps": 4}, 1.0), (2, {"decay": "cosine", "decay_steps": 4}, 0.5),
    (4, {"decay": "cosine", "decay_steps": 4}, 0.0), (1, {"decay": "linear", "decay_steps": 4}, 0.75),
])
def test_the_formula_at_hand_computed_points(u: int, kw: dict, want: float) -> None:
    assert lr_at(u, lr=1.0, **kw) == pytest.approx(want, rel=1e-15, abs=1e-15)
    assert LrSchedule(**kw).lr(u, 1.0) == lr_at(u, lr=1.0, **kw)


SETTINGS = [LrSchedule(warmup=3, decay="cosine", min_lr=0.01, decay_steps=9),
            LrSchedule(warmup=0, decay="linear", min_lr=0.0, decay_steps=5), LrSchedule(warmup=4)]


@pytest.mark.parametrize("schedule", SETTINGS, ids=lambda s: s.describe())
def test_an_optimizer_follows_lambdalr_driven_the_same_way(schedule: LrSchedule) -> None:
    """Two param groups with their own peaks, Adam: ScheduledLr before each step against torch's LambdaLR (one
    lambda per group, f(u) / its peak) stepped after each, written from tests/reference.py's formula."""
    def model() -> list[dict]:
        torch.manual_seed(0)
        a, b = nn.Linear(3, 3).double(), nn.Linear(3, 1).double()
        return [{"params": a.parameters(), "lr": 0.1}, {"params": b.parameters(), "lr": 0.03}]

    ours, theirs = torch.optim.Adam(model()), torch.optim.Adam(model())
    peaks = [0.1, 0.03]
    curves = [warmup_decay(p, warmup=schedule.warmup, decay=schedule.decay, min_lr=schedule.min_lr,
                           decay_steps=schedule.decay_steps) for p in peaks]
    lambdalr = torch.optim.lr_scheduler.LambdaLR(theirs, [lambda u, f=f, p=p: f(u) / p for f, p in zip(curves, peaks)])
    driver = ScheduledLr(schedule, ours, per_update=4, microbatches=4)
    driver.begin(0)
    for u in range(12):
        for opt in (ours, theirs):
            opt.zero_grad()
            sum((p * (u + 1)).square().sum() for g in opt.param_groups for p in g["params"]).backward()
        driver.set(driver.take())
        assert [g["lr"] for g in ours.param_groups] == pytest.approx([g["lr"] for g in theirs.param_groups],
                                                                     rel=1e-13)
        ours.step()
        theirs.step()
        lambdalr.step()
    for p, q in zip([p for g in ours.param_groups for p in g["params"]],
                    [p for g in theirs.param_groups for p in g["params"]]):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_which_update_is_u() -> None:
    """Flush and 2bw: the u-th STEP's gradient is update u. async (an update per `replicas` microbatches of a
    stage): u is the minibatch of the update's first microbatch, so every stage follows the same curve in steps.
    A run or segment starting at minibatch k starts there."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    flush = ScheduledLr(LrSchedule(warmup=2), opt, per_update=4, microbatches=4)
    flush.begin(5)  # a resumed run at step 5
    assert [flush.take() for _ in range(3)] == [5, 6, 7]
    replicated = ScheduledLr(LrSchedule(warmup=2), opt, per_update=2, microbatches=4)  # async, 2 replicas
    replicated.begin(3)  # a segment from minibatch 3: microbatch 12, its stage's update 6
    assert [replicated.take() for _ in range(5)] == [3, 3, 4, 4, 5]
    uneven = ScheduledLr(LrSchedule(warmup=2), opt, per_update=2, microbatches=3)  # updates straddle minibatches
    uneven.begin(0)
    assert [uneven.take() for _ in range(6)] == [0, 0, 1, 2, 2, 3]  # first microbatches 0, 2, 4, 6, 8, 10


@pytest.mark.parametrize("deferred", [False, True], ids=["at-once", "deferred"])
def test_a_skipped_update_uses_its_index_up_and_a_held_one_keeps_its_own(deferred: bool) -> None:
    """The gate skips the gradient of STEP 1: the schedule still moves on (Megatron's is a function of the
    iteration), and a deferred update (2bw's last stage) applies g_k at STEP k + 1 with update k's lr."""
    p = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=1.0)
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
    schedule = LrSchedule(warmup=3)  # 0.25, 0.5, 0.75, 1.0
    update = Update(opt, [p], None, [], deferred=deferred, late=False, broadcast_overlaps=False,
                    lr=scheduled_lr(schedule, opt, per_update=2, microbatches=2))
    update.begin(0)
    for k in range(4):
        p.grad = torch.ones(1, dtype=torch.float64)
        update.reduce()
        update.step(lambda k=k: k != 1, [])
    update.drain(None)
    assert used == [0.25, 0.75, 1.0]  # updates 0, 2 and 3; deferred: at STEPs 1 and 3 and at the drain
    assert float(p.detach()) == -2.0


# ---------------------------------------------------------------- refusals

BASE = ["--model", "mlp", "--device", "cpu", "--layers-per-stage", "even", "--lr", "0.001", "--steps", "10"]


@pytest.mark.parametrize("flags,line", [
    (["--lr-warmup=-1"], "--lr-warmup must be >= 0 updates, found -1"),
    (["--lr-decay", "cosine", "--min-lr", "0.01"], "--min-lr must be a finite number with 0 <= --min-lr <= --lr "
                                                   "(the floor the decay reaches), found --min-lr 0.01 and --lr 0.001"),
    (["--lr-decay", "cosine", "--min-lr", "nan"], "--min-lr must be a finite number with 0 <= --min-lr <= --lr "
                                                  "(the floor the decay reaches), found --min-lr nan and --lr 0.001"),
    (["--lr-decay", "linear", "--min-lr=-1e-05"], "--min-lr must be a finite number with 0 <= --min-lr <= --lr "
                                                     "(the floor the decay reaches), found --min-lr -1e-05 and --lr "
                                                     "0.001"),
    (["--lr-decay", "cosine", "--lr-decay-steps", "0"], "--lr-decay-steps must be >= 1 update, found 0"),
    (["--lr-decay", "cosine", "--lr-warmup", "10"], "--lr-decay cosine needs --lr-decay-steps (default: --steps) > "
                                                    "--lr-warmup, the decay running from the warm-up's end to that "
                                                    "update; found --steps 10 and --lr-warmup 10"),
    (["--lr-decay", "linear", "--lr-warmup", "5", "--lr-decay-steps", "3"],
     "--lr-decay linear needs --lr-decay-steps (default: --steps) > --lr-warmup, the decay running from the warm-up's "
     "end to that update; found --lr-decay-steps 3 and --lr-warmup 5"),
    (["--min-lr", "1e-05"], "--min-lr needs a decay (--lr-decay cosine or linear), found --lr-decay none"),
    (["--lr-warmup", "3", "--min-lr", "1e-05", "--lr-decay-steps", "8"],
     "--min-lr and --lr-decay-steps need a decay (--lr-decay cosine or linear), found --lr-decay none"),
])
def test_bad_schedules_are_refused_in_one_line(flags: list[str], line: str) -> None:
    with pytest.raises(config.ConfigError) as e:
        check_args(build_parser().parse_args([*BASE, *flags]))
    assert str(e.value) == line


def test_an_unknown_decay_is_a_usage_error(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*BASE, "--lr-decay", "exp"])
    err = capfd.readouterr().err
    assert e.value.code == 2 and "pipeflow-train: error: argument --lr-decay: invalid choice: 'exp'" in err, err


def test_the_api_refuses_the_same_in_its_own_names() -> None:
    with pytest.raises(ValueError, match=r"^LrSchedule.warmup must be >= 0 updates, found -2$"):
        LrSchedule(warmup=-2)
    with pytest.raises(ValueError, match=r"^LrSchedule.decay cosine needs LrSchedule.decay_steps, the update at "
                                         r"which the decay reaches LrSchedule.min_lr; found none$"):
        LrSchedule(decay="cosine")
    with pytest.raises(ValueError, match=r"^LrSchedule.decay must be one of none, cosine, linear, found 'step'$"):
        LrSchedule(decay="step")
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))]}, {"params": [nn.Parameter(torch.zeros(1))],
                                                                         "lr": 1e-4}], lr=0.1)
    with pytest.raises(ValueError, match=r"^LrSchedule.min_lr 0.001 is above param group 1's lr 0.0001, the peak "):
        ScheduledLr(LrSchedule(decay="linear", min_lr=1e-3, decay_steps=9), opt, per_update=1, microbatches=1)
    assert pipeflow.LrSchedule is LrSchedule


def test_the_flags_make_the_schedule() -> None:
    args = check_args(build_parser().parse_args([*BASE, "--lr-warmup", "2", "--lr-decay", "cosine",
                                                  "--min-lr", "1e-05"]))
    assert args.lr_schedule == LrSchedule(warmup=2, decay="cosine", min_lr=1e-5, decay_steps=10)  # K: --steps
    longer = check_args(build_parser().parse_args([*BASE, "--lr-decay", "linear", "--lr-decay-steps", "40"]))
    assert longer.lr_schedule == LrSchedule(decay="linear", decay_steps=40)
    assert check_args(build_parser().parse_args(BASE)).lr_schedule is None  # a constant --lr, as before


# ---------------------------------------------------------------- under mpirun

MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}
STEPS, M, B, LR, MIN_LR = 6, 4, 2, 0.05, 0.005
OPTIM = {"optimizer": "sgd", "lr": LR, "momentum": 0.9}

# name: (schedule, plan stages [(layers, replicas)], decay, --lr-decay-steps, extra flags, resumed from a checkpoint)
RUNS = {
    "1f1b-2": ("1f1b", [(3, 1), (3, 1)], "cosine", None, [], True),
    "1f1b-4-replicated": ("1f1b", [(2, 2), (2, 1), (2, 1)], "cosine", None, [], False),
    "gpipe-2": ("gpipe", [(3, 1), (3, 1)], "linear", None, [], False),
    # stage 0 postpones its clipped update to the weights' next reader, stage 1 defers its update a STEP
    "2bw-2-clipped": ("2bw", [(3, 1), (3, 1)], "cosine", None, ["--clip-grad-norm", "0.5"], False),
    # data parallel: each update deferred, its all-reduce under the next minibatch; K = 4 < --steps: the floor
    "2bw-2-dp": ("2bw", [(6, 2)], "cosine", 4, [], False),
    # stage 0 updates every 2 microbatches (its replicas'), stage 1 every one; segments of 3 minibatches
    "async-3-replicated": ("async", [(2, 2), (4, 1)], "cosine", None, [], True),
}


def flags(name: str) -> list[str]:
    _, _, decay, end, extra, _ = RUNS[name]
    return ["--lr-warmup", "2", "--lr-decay", decay, "--min-lr", str(MIN_LR), *extra,
            *(["--lr-decay-steps", str(end)] if end is not None else [])]


def scheduled(d: Path, name: str) -> list[Case]:
    """The run (with --checkpoint-every 3 where it is resumed) and then, where resumed, the same from step 3."""
    schedule, stages, _, _, _, resumed = RUNS[name]
    n = write_plan(d / "plan.json", schedule, M, stages)
    args = ["--model", "mlp", "--model-args", json.dumps(MLP), "--plan", str(d / "plan.json"), "--steps", str(STEPS),
            "--microbatch-size", str(B), "--optimizer", "sgd", "--lr", str(LR), "--momentum", "0.9", "--dtype",
            "float64", "--device", "cpu", *flags(name)]
    if not resumed:
        return [Case(n, [*args, "--save", str(d / "model.pt")])]
    whole = Case(n, [*args, "--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "3", "--log-every", "1",
                     "--tensorboard", str(d / "tb"), "--save", str(d / "model.pt")], env={"PIPEFLOW_LOG": "INFO"})
    return [whole, Case(n, [*args, "--checkpoint-dir", str(d / "ck2"), "--checkpoint-every", "3", "--resume",
                            str(d / "ck" / "step-000003"), "--save", str(d / "resumed.pt")])]


@pytest.mark.parametrize("name", list(RUNS))
@batched(scheduled)
def test_scheduled_pipeline_equals_one_process_setting_each_updates_lr(mpi: MpiRun, name: str) -> None:
    schedule, stages, decay, end, extra, resumed = RUNS[name]
    f = warmup_decay(LR, warmup=2, decay=decay, min_lr=MIN_LR, decay_steps=end or STEPS)
    kw = {"steps": STEPS, "microbatches": M, "microbatch_size": B, **OPTIM}
    if schedule in ("2bw", "async"):
        kw.update(schedule=schedule, stages=stages, segment=3 * M if resumed else None,
                  clip=0.5 if extra else None)
        want, constant = reference_delayed("mlp", MLP, lr_at=f, **kw), reference_delayed("mlp", MLP, **kw)
    else:
        want, constant = reference_flush("mlp", MLP, lr_at=f, **kw), reference_flush("mlp", MLP, **kw)
    # The schedule matters: --lr throughout trains other weights.
    assert any(not torch.allclose(want[k], constant[k], rtol=1e-6, atol=1e-8) for k in want)
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=f"{name}: {k}")
    if resumed:  # from the checkpoint at step 3: the schedule goes on at update 3 (the optimizer's saved lr unused)
        again = torch.load(mpi.dir / "resumed.pt", weights_only=True)
        for k in want:
            torch.testing.assert_close(again[k], want[k], rtol=1e-9, atol=1e-11, msg=f"{name} resumed: {k}")


@batched(scheduled)
@pytest.mark.parametrize("name", ["1f1b-2"])
def test_tensorboard_and_the_loss_lines_show_each_steps_lr(mpi: MpiRun, name: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    f = warmup_decay(LR, warmup=2, decay="cosine", min_lr=MIN_LR, decay_steps=STEPS)
    board = EventAccumulator(str(mpi.dir / "tb"), size_guidance={"scalars": 0})
    board.Reload()
    shown = [(e.step, e.value) for e in board.Scalars("lr")]
    assert [k for k, _ in shown] == list(range(1, STEPS + 1))
    assert [v for _, v in shown] == pytest.approx([f(k) for k in range(STEPS)], rel=1e-6)  # step k + 1: update k's
    lines = [line for line in mpi.procs[0].stderr.splitlines() if "pipeflow.monitor: step " in line]
    assert [line.split("  ")[2] for line in lines] == [f"lr {f(k):.4g}" for k in range(STEPS)], lines
    assert "learning rate 0.05: linear warm-up over 2 updates, then cosine decay to 0.005 at update 6" in \
        mpi.procs[0].stderr


def refused(d: Path) -> Case:
    return Case(2, [*BASE, "--lr-decay", "cosine", "--lr-warmup", "12"], check=False)


@batched(refused)
def test_a_bad_schedule_stops_the_job_at_set_up_in_one_line(mpi: MpiRun) -> None:
    lines = [line for line in mpi.proc.stderr.splitlines() if "pipeflow-train" in line]
    assert mpi.proc.returncode == 2 and lines == [
        "pipeflow-train: error: --lr-decay cosine needs --lr-decay-steps (default: --steps) > --lr-warmup, the decay "
        "running from the warm-up's end to that update; found --steps 10 and --lr-warmup 12"], mpi.proc.stderr
    assert "Traceback" not in mpi.proc.stderr
