"""--clip-grad-norm MAX (pipeflow/clip.py): pipelined runs whose clipping bites on every step equal one process calling
torch.nn.utils.clip_grad_norm_(model.parameters(), MAX) before each optimizer step (2bw: its delayed reference
clipping each update's gradient); async and bad values are refused in one line."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner.plan import even_plan
from pipeflow import config
from pipeflow.clip import GradClip, Norm, grad_clip, square_sum
from pipeflow.kinds import schedule_kind
from pipeflow.schedule import SCHEDULES, Kind, dependencies, dry_run, generate
from pipeflow.stash import defers_update, version_fn
from pipeflow.train import build_parser, check_args
from tests.conftest import Case, MpiRun, batched, write_plan
from tests.reference import reference_delayed, reference_flush

MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}
GPT_TIED = {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256, "tie": True}  # head = embedding
MODELS = {"mlp": MLP, "gpt": GPT_TIED}
MAX = 0.5  # below every step's norm in these runs (1.0 to 1.9): the coefficient is < 1 on every step
STEPS, M, B = 3, 4, 2
OPTIM = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}

# name: (model, schedule, -np, plan stages as (layers, replicas) or None for --layers-per-stage even, extra flags)
RUNS = {
    "1f1b-1": ("mlp", "1f1b", 1, None, []),  # one process: no collective
    "1f1b-2": ("mlp", "1f1b", 2, None, []),
    "gpipe-2": ("mlp", "gpipe", 2, None, []),
    "1f1b-tied-2": ("gpt", "1f1b", 2, None, []),  # the tied embedding counted once, after its sum over the stages
    "1f1b-4-replicated": ("mlp", "1f1b", 4, [(2, 2), (2, 1), (2, 1)], []),
    "1f1b-4-sharded": ("mlp", "1f1b", 4, [(2, 2), (2, 1), (2, 1)], ["--shard-optimizer"]),
    "2bw-2": ("mlp", "2bw", 2, None, []),  # stage 0 runs ahead (its update waits for the weights' reader), 1 defers
    "2bw-4-sharded": ("mlp", "2bw", 4, [(3, 2), (3, 2)], ["--shard-optimizer"]),
}


def clipped(d: Path, name: str) -> Case:
    model, schedule, np_, stages, extra = RUNS[name]
    if stages is None:
        split = ["--schedule", schedule, "--layers-per-stage", "even", "--microbatches", str(M)]
    else:
        write_plan(d / "plan.json", schedule, M, stages)
        split = ["--plan", str(d / "plan.json")]
    return Case(np_, ["--model", model, "--model-args", json.dumps(MODELS[model]), *split, "--steps", str(STEPS),
                      "--microbatch-size", str(B), "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
                      "--dtype", "float64", "--device", "cpu", "--clip-grad-norm", str(MAX), *extra,
                      "--log-every", "1", "--tensorboard", str(d / "tb"), "--save", str(d / "model.pt")])


@pytest.mark.parametrize("name", list(RUNS))
@batched(clipped)
def test_clipped_pipeline_equals_single_process_clipping(mpi: MpiRun, name: str) -> None:
    model, schedule, np_, stages, _ = RUNS[name]
    norms: list[float] = []
    if schedule == "2bw":
        layers = [(3, 1), (3, 1)] if stages is None else stages
        want = reference_delayed(model, MODELS[model], schedule="2bw", stages=layers, steps=STEPS, microbatches=M,
                                 microbatch_size=B, clip=MAX, norms=norms, **OPTIM)
    else:
        want = reference_flush(model, MODELS[model], steps=STEPS, microbatches=M, microbatch_size=B, clip=MAX,
                               norms=norms, **OPTIM)
    # Clipping bites on every step: an ignored --clip-grad-norm would train other weights.
    assert len(norms) == STEPS and all(MAX / (n + 1e-6) < 1 for n in norms), norms
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=f"{name}: {k}")
    # Each report shows the norm before clipping, as clip_grad_norm_ returns it; 2bw's last stage, which applies each
    # gradient a STEP late, the previous minibatch's from the second report on.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(mpi.dir / "tb"), size_guidance={"scalars": 0})
    board.Reload()
    shown = [(e.step, e.value) for e in board.Scalars("grad/norm")]
    first, want_norms = (2, norms[:-1]) if schedule == "2bw" else (1, norms)
    assert [k for k, _ in shown] == list(range(first, STEPS + 1)), shown
    assert [v for _, v in shown] == pytest.approx(want_norms, rel=1e-6), (shown, norms)


ASYNC_LINE = ("pipeflow-train: error: --clip-grad-norm needs one gradient norm over all stages per update, which "
              "--schedule async does not have: each stage updates after each of its microbatches, at its own time, "
              "and a norm over the stages would stall the pipeline; use --schedule 2bw (asynchronous, one update per "
              "minibatch) or a flush schedule such as 1f1b")


def async_clipped(d: Path) -> Case:
    return Case(2, ["--model", "mlp", "--model-args", json.dumps(MLP), "--schedule", "async", "--layers-per-stage",
                    "even", "--device", "cpu", "--clip-grad-norm", "1"], check=False)


@batched(async_clipped)
def test_async_with_clipping_is_refused_in_one_line(mpi: MpiRun) -> None:
    lines = [line for line in mpi.proc.stderr.splitlines() if "pipeflow-train" in line]
    assert mpi.proc.returncode == 2 and lines == [ASYNC_LINE], mpi.proc.stderr
    assert "[rank" not in mpi.proc.stderr and "Traceback" not in mpi.proc.stderr


def nonfinite_clipped(d: Path) -> Case:
    return Case(2, ["--model", "tests.test_bad_input:nan_data_mlp", "--model-args", json.dumps(MLP), "--device", "cpu",
                    "--layers-per-stage", "even", "--optimizer", "sgd", "--microbatches", "2", "--steps", "50",
                    "--skip-nonfinite", "--max-skips", "3", "--clip-grad-norm", "1"], check=False)


@batched(nonfinite_clipped)
def test_nonfinite_gradients_are_gated_as_without_clipping(mpi: MpiRun) -> None:
    """The gate checks each stage's own gradients before they are scaled: its line names the stages they came from,
    as without --clip-grad-norm (tests/test_bad_input.py), and the skips stop the run."""
    lines = [line for line in mpi.proc.stderr.splitlines() if "pipeflow-train" in line]
    assert mpi.proc.returncode == 4 and lines == [
        "pipeflow-train: non-finite loss on stage 1 (the last) and gradients on stages 0, 1 at step 3: 3 consecutive "
        "steps skipped (3 in all; --skip-nonfinite stops after --max-skips 3 in a row), the run is not recovering. "
        "Lower --lr or check the data"], mpi.proc.stderr


BASE = ["--model", "mlp", "--model-args", json.dumps(MLP), "--device", "cpu", "--layers-per-stage", "even"]


@pytest.mark.parametrize("value,shown", [("0", "0.0"), ("-1", "-1.0"), ("nan", "nan"), ("inf", "inf")])
def test_bad_clip_values_are_refused_in_one_line(value: str, shown: str) -> None:
    with pytest.raises(config.ConfigError) as e:
        check_args(build_parser().parse_args([*BASE, "--clip-grad-norm", value]))
    assert str(e.value) == (f"--clip-grad-norm must be a finite number > 0 (the most the gradients' global L2 norm "
                            f"may be), found {shown}")


def test_async_is_refused_from_the_flag_and_from_the_plan() -> None:
    with pytest.raises(config.ConfigError) as e:
        check_args(build_parser().parse_args([*BASE, "--schedule", "async", "--clip-grad-norm", "1"]))
    assert f"pipeflow-train: error: {e.value}" == ASYNC_LINE
    args = build_parser().parse_args([*BASE, "--clip-grad-norm", "1"])
    with pytest.raises(config.ConfigError, match=r"^--clip-grad-norm needs one gradient norm over all stages per "
                                                 r"update, which the plan's schedule async does not have"):
        config.check_plan(even_plan(4, 2, schedule="async", microbatches=4), args, SCHEDULES)
    for schedule in ("1f1b", "2bw", "interleaved", "zb"):  # every other schedule has one update per minibatch
        check_args(build_parser().parse_args([*BASE, "--schedule", schedule, "--clip-grad-norm", "1"]))


# ---------------------------------------------------------------- in one process


def _grads(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    net(torch.randn(4, 5, dtype=torch.float64)).square().sum().backward()
    return net


@pytest.mark.parametrize("max_norm", [0.1, 1e6])
def test_one_rank_clips_as_torch(max_norm: float) -> None:
    net, ref = _grads(0), _grads(0)
    clip = GradClip(max_norm, list(net.parameters()), torch.device("cpu"), 1, agreed=True)
    assert clip.scale(clip.launch(), [p.grad for p in net.parameters()], object())
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


def test_shares_sum_to_the_whole_norm_and_the_replicas_split_the_work() -> None:
    """Replica q counts the parameters shard.owners gives it: over the replicas, every parameter once."""
    net = _grads(1)
    kind = schedule_kind("1f1b")

    class World:
        device, size = torch.device("cpu"), 1

    shares = [grad_clip(1.0, list(net.parameters()), [], {}, 2, q, World(), kind) for q in range(2)]  # type: ignore[arg-type]
    counted = [[id(p) for p in c.counted] for c in shares if c is not None]
    assert sorted(counted[0] + counted[1]) == sorted(id(p) for p in net.parameters()) and all(counted)
    whole = square_sum([p.grad for p in net.parameters()], torch.device("cpu"))
    parts = sum(c.launch().shares.sum() for c in shares if c is not None)
    torch.testing.assert_close(parts, whole, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="async updates per microbatch"):
        grad_clip(1.0, list(net.parameters()), [], {}, 1, 0, World(), schedule_kind("async"))  # type: ignore[arg-type]


def test_a_nonfinite_norm_skips_the_update() -> None:
    """Another stage's NaN reaches this rank through the norm: where no agreement at the STEP covers it (2bw) the
    update is skipped; where the gate armed a skip on the device, the norm's flag joins it."""
    net = _grads(2)
    grads = [p.grad for p in net.parameters()]
    nan = Norm(torch.tensor([1.0, math.nan], dtype=torch.float64), None)
    assert not GradClip(1.0, [], torch.device("cpu"), 1, agreed=False).scale(nan, grads, object())
    assert GradClip(1.0, [], torch.device("cpu"), 1, agreed=True).scale(nan, grads, object())

    class Armed:
        found_inf = torch.zeros((), dtype=torch.float32)

    opt = Armed()
    assert GradClip(1.0, [], torch.device("cpu"), 1, agreed=False).scale(nan, grads, opt)
    assert float(opt.found_inf) == 1.0  # the fused optimizer skips on the device
    opt.found_inf = torch.zeros((), dtype=torch.float32)  # the gate arms it afresh at every STEP
    finite = Norm(torch.tensor([4.0], dtype=torch.float64), None)
    assert GradClip(1.0, [], torch.device("cpu"), 1, agreed=False).scale(finite, grads, opt)
    assert float(opt.found_inf) == 0.0


@pytest.mark.parametrize("reps,m", [((1, 1), 1), ((1, 1), 4), ((1, 1, 1), 2), ((1, 1, 1, 1), 3), ((1, 1, 1, 1), 6),
                                    ((2, 1), 2), ((1, 2), 3), ((2, 1, 1), 4), ((2, 2), 4), ((3,), 3)])
def test_2bw_reads_each_norm_where_no_rank_waits_back(reps: tuple[int, ...], m: int) -> None:
    """2bw's norm of g_k (launched at each rank's STEP k) is read at a deferred worker's next STEP, and on a worker
    that runs ahead at its first forward of minibatch k + 2 (or its next STEP): a dry run of the action lists with
    those waits added (schedule.dry_run's rules) ends, so no rank waits for one that waits for it."""
    sched = generate("2bw", len(reps), 4 * m, list(reps), minibatch=m)
    deps = dependencies(sched)
    steps = [[i for i, a in enumerate(acts) if a.kind is Kind.STEP] for acts in sched.actions]
    for w, acts in enumerate(sched.actions):
        deferred = defers_update(acts, version_fn(sched, sched.stage_of(w), minibatch=m))
        last = sched.stage_of(w) == len(reps) - 1
        for k, at in enumerate(steps[w]):
            after = steps[w][k + 1] if k + 1 < len(steps[w]) else len(acts)
            ahead = [i for i in range(at + 1, after) if acts[i].kind is Kind.F and acts[i].microbatch // m >= k + 2]
            # deferred: the next STEP; running ahead: the first forward on the next weights; else this STEP itself
            read = at if last and not deferred else ahead[0] if ahead and not deferred else after
            if read < len(acts):  # none: read at the segment's end (drain), after every list
                deps[w][read] = deps[w][read] + [(x, steps[x][k] - 1) for x in range(len(sched.actions))]
    dry_run(sched, deps)  # a deadlock raises ScheduleError with the grid


def test_the_norms_gather_uses_only_what_every_torch_has(monkeypatch: pytest.MonkeyPatch, one_rank_group: Any) -> None:
    """The GPU machines' torch 2.11 has no dist.all_gather_single: every clipped multi-rank run stopped there at
    set-up (found on 2 x H200). comm.all_gather is an all-reduce of each rank's value at its own index."""
    import torch.distributed as dist

    from pipeflow.comm import all_gather

    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "all_gather_into_tensor", raising=False)
    out = torch.full((1,), float("nan"), dtype=torch.float64)
    all_gather(out, torch.tensor([2.5], dtype=torch.float64)).wait()
    assert out.tolist() == [2.5]
