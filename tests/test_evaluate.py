"""Forward-only evaluation (pipeflow/evaluate.py): Pipeline.evaluate between steps equals one process's
`model.eval(); with torch.no_grad()` evaluation (float64) under 1f1b (dropout and BatchNorm, a module frozen in eval
mode), interleaved, a replicated last stage, async and 2bw, and the steps around it train as without it;
pipeflow-train --eval-every reports the reference's losses in TensorBoard's loss/eval; the refusals are one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeflow.api import Pipeline
from pipeflow.config import ConfigError, TrainConfig
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.evaluate import eval_mode
from pipeflow.spec import build_model
from tests import api_eval_loop
from tests.conftest import Case, MpiRun, batched, write_plan
from tests.reference import reference_delayed, reference_flush

# (name, -np, schedule, model, plan stages as (layers, replicas) or None for Pipeline's even split)
SETUPS = [("1f1b", 2, "1f1b", "normdrop", None),
          ("interleaved", 2, "interleaved", "normdrop", None),  # 4 chunks of one layer on 2 ranks
          ("last-replicated", 4, "1f1b", "mlp", [(2, 1), (1, 1), (1, 2)]),
          ("async", 2, "async", "mlp", None),
          ("2bw", 2, "2bw", "mlp", None)]
M = 4


def user_loop(d: Path, name: str) -> Case:
    _, np, schedule, model, stages = next(s for s in SETUPS if s[0] == name)
    args = [str(d / "out"), schedule, str(M), model]
    if stages is not None:
        write_plan(d / "plan.json", schedule, M, stages)
        args.append(str(d / "plan.json"))
    return Case(np, args, main="tests.api_eval_loop:main")


@pytest.mark.parametrize("name", [s[0] for s in SETUPS])
@batched(user_loop)
def test_evaluate_between_steps_equals_one_process_evaluation(mpi: MpiRun, name: str) -> None:
    _, np, schedule, model, stages = next(s for s in SETUPS if s[0] == name)
    ranks = [json.loads((mpi.dir / "out" / f"rank{r}.json").read_text()) for r in range(np)]
    assert [r["owner"] for r in ranks].count(True) == 1
    assert all(r["modes_kept"] for r in ranks), "evaluate left a module in another mode than it had"
    assert sum(r["frozen"] for r in ranks) == (1 if model == "normdrop" else 0)
    got = torch.load(mpi.dir / "out" / "model.pt", weights_only=True)
    if schedule in ("async", "2bw"):  # each step drains its pipeline: a segment of one minibatch
        reps = [(2, 1), (2, 1)]
        states = [reference_delayed(model, api_eval_loop.MODELS[model][1], schedule=schedule, stages=reps, steps=k,
                                    microbatches=M, microbatch_size=api_eval_loop.B, lr=api_eval_loop.LR, segment=M)
                  for k in range(api_eval_loop.STEPS + 1)]
        want, want_evals = states[-1], [api_eval_loop.evaluate_state(model, s, M) for s in states]
        want_losses = None
    else:
        want, want_losses, want_evals = api_eval_loop.reference(model, M)
    for r, out in enumerate(ranks):
        if not out["owner"]:
            assert out["evals"] == [[None, None]] * (api_eval_loop.STEPS + 1), f"rank {r}"
            continue
        f64 = torch.float64
        torch.testing.assert_close(torch.tensor(out["evals"], dtype=f64), torch.tensor(want_evals, dtype=f64),
                                   rtol=1e-9, atol=0)
        if want_losses is not None:
            torch.testing.assert_close(torch.tensor(out["steps"], dtype=f64), torch.tensor(want_losses, dtype=f64),
                                       rtol=1e-9, atol=0)
    # The steps between evaluations trained as without them (buffers too: BatchNorm's running statistics).
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=f"{name}: {k}")


# ---------------------------------------------------------------- pipeflow-train --eval-every

MLP = {"layers": 4, "hidden": 8, "d_in": 4, "samples": 64}  # eval_dataset: 16 samples, two minibatches of 4 x 2
CLI = ["--model", "mlp", "--model-args", json.dumps(MLP), "--layers-per-stage", "even", "--steps", "4",
       "--microbatches", str(M), "--microbatch-size", "2", "--optimizer", "sgd", "--lr", "0.05", "--dtype", "float64",
       "--device", "cpu", "--eval-every", "2", "--eval-batches", "2"]


def cli(d: Path) -> list[Case]:
    return [Case(2, [*CLI, "--schedule", "1f1b", "--log-every", "1", "--tensorboard", str(d / "tb")],
                 env={"PIPEFLOW_LOG": "INFO"}),
            Case(2, [*CLI, "--schedule", "2bw", "--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "2",
                     "--tensorboard", str(d / "tb2bw"), "--save", str(d / "2bw.pt")]),
            Case(2, ["--model", "tests.models:dropout_mlp", "--eval-every", "2", "--device", "cpu"], check=False)]


def evaluate_mlp(state: dict[str, torch.Tensor]) -> float:
    """One process: the first two minibatches of mlp's eval_dataset, in order, in eval mode."""
    spec = build_model("mlp", MLP)
    net = nn.Sequential(*spec.layers).double()
    net.load_state_dict(state)
    net.eval()
    loader = MicrobatchLoader(spec.eval_dataset, 2, shuffle=False)
    with torch.no_grad():
        losses = [float(spec.loss_fn(net(x.double()), y)) for x, y in map(loader.microbatch, range(2 * M))]
    return sum(losses) / len(losses)


def eval_scalars(logdir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss/eval")]


@batched(cli)
def test_eval_every_reports_the_reference_evaluation(mpi: MpiRun) -> None:
    flush, async_, refused = mpi.procs
    want = {k: evaluate_mlp(reference_flush("mlp", MLP, steps=k, microbatches=M, microbatch_size=2)) for k in (2, 4)}
    got = eval_scalars(mpi.dir / "tb")
    assert [s for s, _ in got] == [2, 4]
    for step, value in got:
        assert value == pytest.approx(want[step], rel=1e-6)  # TensorBoard keeps float32
    lines = [ln for ln in flush.stderr.splitlines() if "eval loss" in ln]
    assert [ln.split("INFO pipeflow.monitor: ")[1].split("  (")[0] for ln in lines] == \
        [f"step {k}/4  eval loss {want[k]:.4f}" for k in (2, 4)]
    # 2bw evaluates at its segments' ends (--checkpoint-every 2), on the weights the drained pipeline holds.
    states = {k: reference_delayed("mlp", MLP, schedule="2bw", stages=[(2, 1), (2, 1)], steps=k, microbatches=M,
                                   microbatch_size=2, lr=0.05, segment=2 * M) for k in (2, 4)}
    got = eval_scalars(mpi.dir / "tb2bw")
    assert [s for s, _ in got] == [2, 4]
    for step, value in got:
        assert value == pytest.approx(evaluate_mlp(states[step]), rel=1e-6)
    trained = torch.load(mpi.dir / "2bw.pt", weights_only=True)
    for k, v in states[4].items():
        torch.testing.assert_close(trained[k], v, rtol=1e-9, atol=1e-11)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "pipeflow-train: error: --eval-every 2 evaluates ModelSpec.eval_dataset, which model "
        "'tests.models:dropout_mlp' does not have (None); give its builder's ModelSpec an eval_dataset or drop "
        "--eval-every")


@pytest.mark.parametrize("flags,line", [
    (dict(eval_every=-1), "--eval-every must be >= 0 steps (0: never evaluate), found -1"),
    (dict(eval_every=2, eval_batches=0), "--eval-batches must be >= 1 minibatches, found 0"),
    (dict(eval_every=2, schedule="async", steps=5),
     "--eval-every 2 under --schedule async evaluates where the pipeline drains, at only the run's end (step 5) "
     "without --checkpoint-dir DIR --checkpoint-every C, and step 2 is not one; expected --eval-every 5, or "
     "--checkpoint-every C with 2 a multiple of C, found 2"),
    (dict(eval_every=3, schedule="2bw", steps=8, checkpoint_dir="ck", checkpoint_every=2),
     "--eval-every 3 under --schedule 2bw evaluates where the pipeline drains, at the ends of its --checkpoint-every "
     "2 segments and of the run (step 8), and step 3 is not one; expected --eval-every a multiple of 2, found 3"),
])
def test_eval_flags_are_refused_in_one_line(flags: dict[str, object], line: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig(**flags)  # type: ignore[arg-type]
    assert str(e.value) == line


def test_an_empty_eval_dataset_is_refused_in_one_line() -> None:
    from types import SimpleNamespace

    from pipeflow.evalflags import check_dataset

    with pytest.raises(ValueError) as e:
        check_dataset(TrainConfig(model="mine:build", eval_every=3), SimpleNamespace(eval_dataset=[]))
    assert str(e.value) == "--eval-every 3: model 'mine:build' has an empty eval_dataset"
    check_dataset(TrainConfig(model="mine:build"), SimpleNamespace(eval_dataset=None))  # never evaluates


def test_eval_flags_parse_and_the_asynchronous_schedules_accept_segment_ends() -> None:
    from pipeflow.train import build_parser, check_args

    cfg = check_args(build_parser().parse_args(["--eval-every", "4", "--eval-batches", "3"]))
    assert (cfg.eval_every, cfg.eval_batches) == (4, 3)
    TrainConfig(eval_every=4, schedule="async", steps=9, checkpoint_dir="ck", checkpoint_every=2)  # 4, 8: ends
    TrainConfig(eval_every=5, schedule="2bw", steps=5)  # the run's end
    TrainConfig(eval_every=3, schedule="1f1b", steps=5)  # flush: any step


# ---------------------------------------------------------------- one process


def test_eval_mode_puts_every_module_back_in_its_own_mode() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5), nn.BatchNorm1d(2)))
    net[1][0].eval()  # frozen by the user
    before = [m.training for m in net.modules()]
    with pytest.raises(KeyError), eval_mode([net]):
        assert not any(m.training for m in net.modules())
        raise KeyError  # put back on the way out of an error too
    assert [m.training for m in net.modules()] == before == [True, True, True, False, True]


def one_process(schedule: str, data: MicrobatchLoader | None = None) -> Pipeline:
    return Pipeline(api_eval_loop.build("mlp").layers, F.cross_entropy, schedule=schedule, microbatches=2,
                    device="cpu", data=data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_evaluate_is_refused_inside_a_step_and_without_its_minibatch() -> None:
    spec = api_eval_loop.build("mlp")
    loader = MicrobatchLoader(spec.dataset, 2, seed=0)
    x, y = torch.zeros(4, 4), torch.zeros(4, dtype=torch.long)
    with one_process("async", loader) as pipe:
        with pytest.raises(RuntimeError) as e:
            pipe.run_segment(0, 2, on_step=lambda n: pipe.evaluate(x, y))  # a callback inside the segment
        assert str(e.value) == (
            "Pipeline.evaluate: called inside a training step (from a hook or callback of step or run_segment, or "
            "after one that failed), where microbatches are in flight and, under async and 2bw, stashed weights "
            "are in use; call it between steps")
    with one_process("1f1b") as pipe:
        for args, kwargs, line in [
                ((), {}, "Pipeline.evaluate needs the minibatch: evaluate(x, target=y) on every rank"),
                ((x,), {}, "Pipeline.evaluate needs target= on the last stage's ranks (the loss's input)"),
                ((x, y), {"data": loader}, "Pipeline.evaluate takes the minibatch (x, target) or data=, not both"),
                ((x[:3], y[:3]), {}, "Pipeline.evaluate: the minibatch must split into 2 microbatches of equal size "
                                     "along dimension 0; found shapes [(3, 4)]")]:
            with pytest.raises(ValueError) as v:
                pipe.evaluate(*args, **kwargs)
            assert str(v.value) == line
        seen: list[tuple[bool, bool]] = []
        pipe.engine.stage.module[0].register_forward_hook(
            lambda mod, inputs, out: seen.append((mod.training, torch.is_grad_enabled())))
        assert pipe.evaluate(x, y) is not None  # a world of one owns the loss
        assert seen == [(False, False)] * 2 and not pipe.engine.stage.saved  # eval mode, no graph, nothing kept


def test_the_built_in_models_hold_out_an_eval_dataset() -> None:
    mlp = build_model("mlp", MLP)
    assert mlp.eval_dataset is not None and len(mlp.eval_dataset) == MLP["samples"] // 4
    train_x, held_x = mlp.dataset.tensors[0], mlp.eval_dataset.tensors[0]
    assert not (held_x[:, None, :] == train_x[None, :, :]).all(-1).any()  # no training sample among them
    gpt = build_model("gpt", {"layers": 1, "d_model": 16, "heads": 2, "seq_len": 8, "dataset": "synthetic",
                              "dataset_size": 64})
    assert gpt.eval_dataset is not None and len(gpt.eval_dataset) == 8
    train_rows = {tuple(r.tolist()) for r in gpt.dataset.tokens}
    assert not any(tuple(r.tolist()) in train_rows for r in gpt.eval_dataset.tokens)
    text = build_model("gpt", {"layers": 1, "d_model": 16, "heads": 2, "seq_len": 8})
    assert text.eval_dataset is not None and text.eval_dataset[0][0].shape == (8,)
