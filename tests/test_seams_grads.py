"""Gradients at the seams (issue 10, items 2, 4, 6, 7) under mpirun, against single-process training:
replicas leave a parameter without gradient alone and wait for a gradient accumulated twice; a
Parameter tied across stages trains as one; sends are released as they complete; async replicas average."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

from pipeflow import checkpoint, restore
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.hooks import WeightPolicy
from pipeflow.reduce import find_ties
from pipeflow.spec import build_model
from pipeflow.stage import Stage
from pipeflow.structure import OutputError
from tests.conftest import Case, MpiRun, batched, in_background, run_mpi, write_plan
from tests.reference import reference_delayed, reference_flush

SMALL = {"d_in": 6, "hidden": 8, "classes": 3, "samples": 64}
GPT = {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256, "tie": True}
MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}
B = 2


def reference(model: str, model_args: dict, *, steps: int, microbatches: int, optimizer: str, lr: float,
              momentum: float = 0.0, weight_decay: float = 0.0) -> dict[str, torch.Tensor]:
    """One process, float64: per step the mean of m microbatch losses, then torch.optim's step with the
    same flags pipeflow-train turns into an optimizer (weight decay included)."""
    spec = build_model(model, model_args, seed=0)
    net = nn.Sequential(*spec.layers).double()
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay) if optimizer == "sgd"
        else torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay))
    loader = MicrobatchLoader(spec.dataset, B, seed=0)
    for k in range(steps):
        opt.zero_grad(set_to_none=True)
        for i in range(microbatches):
            x, y = loader.microbatch(k * microbatches + i)
            x = tree_map(lambda t: t.double() if t.is_floating_point() else t, x)  # a dict input's too
            (spec.loss_fn(net(x), y) / microbatches).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def train(d: Path, model: str, model_args: dict, stages: list[tuple[int, int]], *, schedule: str, m: int,
          steps: int, extra: list[str], name: str = "model.pt") -> Case:
    """The case that trains `model` on a plan of `stages` and saves it to d/name."""
    plan = d / f"plan-{name}.json"
    np_ = write_plan(plan, schedule, m, stages)
    return Case(np_, ["--model", model, "--model-args", json.dumps(model_args), "--plan", str(plan), "--steps",
                      str(steps), "--microbatch-size", str(B), "--dtype", "float64", "--device", "cpu", "--save",
                      str(d / name), *extra])


def saved(mpi: MpiRun, name: str = "model.pt") -> dict[str, torch.Tensor]:
    return torch.load(mpi.dir / name, weights_only=True)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=k)


# ------------------------------------------------------------------ item 2: replicas and missing gradients


def unused_param(d: Path, optimizer: str, inplace: bool) -> Case:
    lr = 0.05 if optimizer == "sgd" else 0.01
    flags = ["--optimizer", optimizer, "--lr", str(lr), "--weight-decay", "0.1"]
    flags += ["--momentum", "0.9"] if optimizer == "sgd" else []
    case = train(d, "tests.models_grads:unused", SMALL, [(1, 1), (2, 2)], schedule="1f1b", m=4, steps=3, extra=flags)
    if inplace:  # every gradient all-reduced in place (reduce.py), its presence in the flags' own all-reduce
        case.env["PIPEFLOW_REDUCE_INPLACE"] = "1"
    return case


@pytest.mark.parametrize("inplace", [False, True], ids=["buckets", "in-place"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@batched(unused_param)
def test_parameter_without_gradient_is_left_alone_by_replicas(mpi: MpiRun, optimizer, inplace):
    """`1.spare` is in a replicated stage but in no forward: momentum, weight decay and AdamW must not move
    it (a zero-filled gradient did: 0.0096 after 3 steps), every other parameter trains as in one process."""
    lr = 0.05 if optimizer == "sgd" else 0.01
    got = saved(mpi)
    want = reference("tests.models_grads:unused", SMALL, steps=3, microbatches=4, optimizer=optimizer, lr=lr,
                     momentum=0.9 if optimizer == "sgd" else 0.0, weight_decay=0.1)
    initial = reference("tests.models_grads:unused", SMALL, steps=0, microbatches=4, optimizer=optimizer, lr=lr)
    assert_same(got, want)
    for k in ("1.spare.weight", "1.spare.bias"):
        assert torch.equal(got[k], initial[k]), k
    assert not torch.equal(got["1.fc.weight"], initial["1.fc.weight"])


def dropped_output(d: Path, schedule: str) -> Case:
    return train(d, "tests.models_grads:dropped", SMALL, [(2, 1), (1, 1)], schedule=schedule, m=4, steps=3,
                 extra=["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1"])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb"])
@batched(dropped_output)
def test_an_output_the_next_stage_drops_leaves_the_parameters_behind_it_alone(mpi: MpiRun, schedule: str) -> None:
    """Stage 1 never reads the second tensor stage 0 sends: in one process `1.side` gets no gradient and AdamW's
    weight decay leaves it alone. Stage 1 sent zeros back for it, and the decay moved it (the losses the same)."""
    got = saved(mpi)
    want = reference("tests.models_grads:dropped", SMALL, steps=3, microbatches=4, optimizer="adamw", lr=0.01,
                     weight_decay=0.1)
    initial = reference("tests.models_grads:dropped", SMALL, steps=0, microbatches=4, optimizer="adamw", lr=0.01)
    assert_same(got, want)
    for k in ("1.side.weight", "1.side.bias"):
        assert torch.equal(got[k], initial[k]), k
    assert not torch.equal(got["1.fc.weight"], initial["1.fc.weight"])


@in_background
def test_an_output_used_by_some_microbatches_only_stops_in_one_line(tmp_path):
    """Which gradients come back is sent once per input signature (pipeflow/gradients.py): a stage that reads a
    received tensor on some microbatches and not on others stops with one line naming both, exit 2 (a launch of
    its own: the one rank that sees it ends the job)."""
    case = train(tmp_path, "tests.models_grads:dropped", {**SMALL, "sometimes": True}, [(2, 1), (1, 1)],
                 schedule="1f1b", m=4, steps=3, extra=["--optimizer", "sgd", "--lr", "0.05"])
    proc = run_mpi(case.np, case.args, timeout=120, check=False)
    lines = [x for x in proc.stderr.splitlines() if "pipeflow-train: error" in x]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert re.search(r"the gradients sent back to rank 0 were \[a gradient, (none|a gradient)\] and now \[a gradient, "
                     r"(a gradient|none)\] for inputs of the same shapes .*: a stage must use the same received "
                     r"tensors for every microbatch", lines[0]), lines[0]
    assert "Traceback" not in proc.stderr


def view_case(d: Path, schedule: str) -> Case:
    return train(d, "tests.models_grads:viewed", SMALL, [(2, 1), (1, 1)], schedule=schedule, m=4, steps=3,
                 extra=["--optimizer", "sgd", "--lr", "0.05"])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb"])
@batched(view_case)
def test_a_view_sent_beside_its_base_is_changed_in_place_with_it(mpi: MpiRun, schedule: str) -> None:
    """Stage 0 returns (h, h[:, :2]); stage 1 scales the view in place, which in one process scales h's first two
    columns too. Sent as two tensors, h kept its old values (weights off by about 0.1 after 3 steps); now the view
    travels inside h and is rebuilt as a view of it (structure.py)."""
    want = reference("tests.models_grads:viewed", SMALL, steps=3, microbatches=4, optimizer="sgd", lr=0.05)
    assert_same(saved(mpi), want)


def reversed_case(d: Path) -> Case:
    return train(d, "tests.models_grads:reversed_view", SMALL, [(2, 1), (1, 1)], schedule="1f1b", m=4, steps=3,
                 extra=["--optimizer", "sgd", "--lr", "0.05"])


@batched(reversed_case)
def test_a_tensor_sharing_memory_with_h_but_with_its_own_backward_travels_apart(mpi: MpiRun) -> None:
    """(h, reverse(h)), a gradient-reversal layer whose forward returns a view: rebuilt as a plain view of h, its
    negated gradient was lost (0.067 after 3 steps); only a torch view operation's output travels inside its base."""
    want = reference("tests.models_grads:reversed_view", SMALL, steps=3, microbatches=4, optimizer="sgd", lr=0.05)
    assert_same(saved(mpi), want)


def unused_2bw(d: Path, late: str) -> Case:
    case = train(d, "tests.models_grads:unused", SMALL, [(1, 1), (2, 2)], schedule="2bw", m=4, steps=3,
                 extra=["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01"])  # the reference's AdamW
    case.env.update({"PIPEFLOW_REDUCE_LATE": late, "PIPEFLOW_LOG": "INFO"})
    return case


@pytest.mark.parametrize("late", ["1", "0"])
@batched(unused_2bw)
def test_2bw_replicas_leave_a_parameter_without_gradient_alone(mpi: MpiRun, late: str) -> None:
    """The same under 2bw, whose replicated last stage defers its update: its all-reduce launched at one STEP and
    completed at the next (update.py's late reduction) or beside the last backward; `1.spare` keeps no gradient
    through the launch and the completion, so AdamW's weight decay leaves it alone (a zero gradient would not)."""
    got = saved(mpi)
    want = reference_delayed("tests.models_grads:unused", SMALL, schedule="2bw", stages=[(1, 1), (2, 2)], steps=3,
                             microbatches=4, microbatch_size=B, optimizer="adamw", lr=0.01)  # weight decay 0.01
    initial = reference("tests.models_grads:unused", SMALL, steps=0, microbatches=4, optimizer="adamw", lr=0.01)
    assert_same(got, want)
    for k in ("1.spare.weight", "1.spare.bias"):
        assert torch.equal(got[k], initial[k]), k
    assert ("the replicas' all-reduce under the next minibatch" in mpi.proc.stderr) is (late == "1")


def sometimes_used(d: Path, inplace: bool) -> Case:
    case = train(d, "tests.models_grads:sometimes", SMALL, [(1, 1), (2, 2)], schedule="1f1b", m=4, steps=6,
                 extra=["--optimizer", "adam", "--lr", "0.01"])
    if inplace:
        case.env["PIPEFLOW_REDUCE_INPLACE"] = "1"
    return case


@pytest.mark.parametrize("inplace", [False, True], ids=["buckets", "in-place"])
@batched(sometimes_used)
def test_a_gradient_one_replica_holds_and_another_not_is_their_sum(mpi: MpiRun, inplace):
    """`1.extra` is used by some microbatches only (a draw per microbatch and layer): in some steps one replica
    has its gradient and the other none, which adds nothing; in steps where no microbatch used it, Adam must
    leave it alone (a zero gradient would move it by its moments). Both reductions (flat buckets, in place)
    train as one process."""
    from pipeflow.stage import layer_seed

    want = reference_flush("tests.models_grads:sometimes", SMALL, steps=6, microbatches=4, microbatch_size=B,
                           optimizer="adam", lr=0.01)
    assert_same(saved(mpi), want)
    draws = []
    for t in range(24):  # the draws the runtime makes: global microbatch t, layer 1 (stage.layer_seed)
        torch.manual_seed(layer_seed(0, t, 1))
        draws.append(float(torch.rand(())) < 0.5)
    by_replica = [[any(draws[s * 4 + i] for i in range(4) if i % 2 == q) for q in (0, 1)] for s in range(6)]
    assert [True, False] in by_replica or [False, True] in by_replica  # the case this test is for occurs


def accumulated_twice(d: Path) -> Case:
    return train(d, "tests.models_grads:twice", SMALL, [(1, 1), (2, 2)], schedule="1f1b", m=4, steps=3,
                 extra=["--optimizer", "sgd", "--lr", "0.05"])


@batched(accumulated_twice)
def test_parameter_accumulated_twice_in_the_last_backward_waits_for_both(mpi: MpiRun):
    """A Linear applied twice under reentrant checkpointing on a replicated stage: its .grad is written
    twice in the last backward of the step, and the replicas must reduce the sum of both."""
    got = saved(mpi)
    assert_same(got, reference("tests.models_grads:twice", SMALL, steps=3, microbatches=4, optimizer="sgd", lr=0.05))


KEPT = {("appended_rows", "1f1b"): [(2, 1), (2, 1)], ("appended_rows", "zb"): [(2, 1), (2, 1)],
        ("kept_input", "1f1b"): [(1, 1), (3, 1)], ("kept_input", "gpipe"): [(1, 1), (3, 1)]}


def kept_runs(d: Path, model: str, schedule: str) -> Case:
    return train(d, f"tests.models_grads:{model}", SMALL, KEPT[model, schedule], schedule=schedule, m=4, steps=3,
                 extra=["--optimizer", "sgd", "--lr", "0.05"])


@pytest.mark.parametrize(("model", "schedule"), sorted(KEPT))
@batched(kept_runs)
def test_what_outlives_a_microbatch_of_a_received_tensor_reads_unchanged(mpi: MpiRun, model: str, schedule: str):
    """appended_rows: stage 0's last layer appends a parameter's rows to its output, and the gradient stage 1 sends
    back for them becomes that parameter's .grad without a copy (a view of the receive buffer). kept_input: stage
    1's first layer keeps its input (a receive buffer) detached, as Transformer-XL keeps its memory, and reads it at
    the next microbatch. Before, the buffer went back to the receive pool after its backward, and a later receive
    overwrote the .grad or what the layer kept."""
    want = reference(f"tests.models_grads:{model}", SMALL, steps=3, microbatches=4, optimizer="sgd", lr=0.05)
    assert_same(saved(mpi), want)


FROZEN = {"1f1b": [(2, 2), (3, 1)], "async": [(2, 1), (3, 1)], "2bw": [(1, 1), (4, 1)]}


def frozen_runs(d: Path, schedule: str) -> Case:
    return train(d, "tests.models_grads:frozen_prefix", SMALL, FROZEN[schedule], schedule=schedule, m=4, steps=3,
                 extra=["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"])


@pytest.mark.parametrize("schedule", sorted(FROZEN))
@batched(frozen_runs)
def test_frozen_parameters_stay_and_the_rest_trains_as_one_process(mpi: MpiRun, schedule: str):
    """Fine-tuning: parameters with requires_grad=False (a whole stage of them, replicated under 1f1b, and a bias
    beside trained weights) keep their values; the others train as one process (async and 2bw: as their delayed
    reference, which now leaves frozen parameters alone too)."""
    got = saved(mpi)
    initial = build_model("tests.models_grads:frozen_prefix", SMALL, seed=0)
    assert torch.equal(got["0.fc.weight"], initial.layers[0].fc.weight.detach().double())
    assert torch.equal(got["3.fc.bias"], initial.layers[3].fc.bias.detach().double())
    if schedule == "1f1b":
        want = reference("tests.models_grads:frozen_prefix", SMALL, steps=3, microbatches=4, optimizer="sgd",
                         lr=0.05, momentum=0.9)
    else:
        want = reference_delayed("tests.models_grads:frozen_prefix", SMALL, schedule=schedule,
                                 stages=FROZEN[schedule], steps=3, microbatches=4, microbatch_size=B,
                                 optimizer="sgd", lr=0.05, momentum=0.9)
    assert not torch.equal(got["2.fc.weight"], initial.layers[2].fc.weight.detach().double())
    assert_same(got, want)


# ------------------------------------------------------------------ item 4: tied weights across stages


def test_tied_gpt_parameters_are_found_across_stages():
    spec = build_model("gpt", GPT)
    assert spec.layers[0].tok.weight is spec.layers[3].lm.weight
    ties = find_ties(spec.layers, [(0, 2), (2, 4)], [[0, 1], [2]])
    assert [(t.keys, t.stages, t.ranks) for t in ties] == [(["0.tok.weight", "3.lm.weight"], [0, 1], [0, 1, 2])]
    assert find_ties(spec.layers, [(0, 4)], [[0]]) == []
    untied = build_model("gpt", {**GPT, "tie": False})
    assert find_ties(untied.layers, [(0, 2), (2, 4)], [[0], [1]]) == []


TIED_SPLITS = {"gpipe-np2": ("gpipe", [(2, 1), (2, 1)]), "1f1b-np2": ("1f1b", [(2, 1), (2, 1)]),
               "1f1b-replicated-np4": ("1f1b", [(1, 2), (2, 1), (1, 1)])}


def tied(d: Path, split: str) -> Case:
    schedule, stages = TIED_SPLITS[split]
    return train(d, "gpt", GPT, stages, schedule=schedule, m=4, steps=3,
                 extra=["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"])


@pytest.mark.parametrize("split", list(TIED_SPLITS))
@batched(tied)
def test_tied_weights_train_as_one_parameter(mpi: MpiRun, split):
    """gpt with the head tied to the token embedding, split so that they land on different stages (and
    replicas): equal to single-process training; --save writes the one parameter under both keys."""
    got = saved(mpi)
    want = reference_flush("gpt", GPT, steps=3, microbatches=4, microbatch_size=B, optimizer="sgd", lr=0.05,
                           momentum=0.9)
    assert_same(got, want)
    assert torch.equal(got["0.tok.weight"], got["3.lm.weight"])


def tied_async(d: Path, schedule: str) -> Case:
    return Case(2, ["--model", "gpt", "--model-args", json.dumps(GPT), "--schedule", schedule, "--layers-per-stage",
                    "even", "--microbatches", "2", "--steps", "1", "--device", "cpu"], check=False)


@pytest.mark.parametrize("schedule", ["async", "2bw"])
@batched(tied_async)
def test_tied_weights_across_stages_are_refused_by_asynchronous_schedules(mpi: MpiRun, schedule):
    """A set-up error (exit 2, no MPI Abort): batched with check=False."""
    proc = mpi.proc
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("pipeflow-train:")]
    # Every rank finds the same error: rank 0 prints it once.
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for line in lines:
        assert line == ("pipeflow-train: error: parameter 0.tok.weight = 3.lm.weight is shared by "
                        f"stages 0, 1, which --schedule {schedule} cannot train: its stages use different weight "
                        "versions of one parameter. Use --schedule gpipe or 1f1b, or a plan that keeps the tied "
                        "layers on one stage")


def _stage_engine(spec, layers: tuple[int, int], s: int) -> SimpleNamespace:
    """The engine attributes checkpoint.py reads, for layers [a, b) of `spec` (no processes)."""
    stage = Stage(spec.layers[layers[0]:layers[1]], start=layers[0], first=s == 0, last=False, loss_fn=None,
                  device=torch.device("cpu"), dtype=torch.float64)
    opt = torch.optim.Adam(stage.parameters(), lr=0.01)

    def state_dict() -> dict[str, torch.Tensor]:
        return {f"{int(k.partition('.')[0]) + layers[0]}.{k.partition('.')[2]}": v.detach().clone()
                for k, v in stage.module.state_dict().items()}

    return SimpleNamespace(stage=stage, optimizer=opt, policy=WeightPolicy(), world=SimpleNamespace(
        device=torch.device("cpu")), s=s, r=0, state_dict=state_dict)


def test_tied_optimizer_state_is_saved_under_every_key(tmp_path):
    """A checkpoint of one stage holding both ends of the tie, resumed with them on two stages: the head's
    copy gets the embedding's Adam state (it was saved under one name only, so it started fresh)."""
    run = {"model": "gpt", "model_args": GPT, "num_layers": 4, "seed": 0, "shuffle": True, "samples_per_step": 8}
    whole = _stage_engine(build_model("gpt", GPT), (0, 4), 0)
    for p in whole.stage.parameters():
        p.grad = torch.full_like(p, 0.1)
    whole.optimizer.step()
    d = checkpoint.step_dir(tmp_path, 1)
    d.mkdir()
    payload = checkpoint.stage_payload(whole, 1, run)
    checkpoint.atomic_write(checkpoint.stage_file(d, 0), lambda f: torch.save(payload, f))
    marker = {"format": checkpoint.CKPT_FORMAT, "step": 1, "run": run,
              "stages": [{"file": checkpoint.stage_file(d, 0).name, "layers": [0, 4]}]}
    (d / checkpoint.MARKER).write_text(json.dumps(marker))
    spec = build_model("gpt", GPT)
    head = _stage_engine(spec, (2, 4), 1)
    assert restore.load(head, d, run) == 1
    tied = whole.stage.module[0].tok.weight
    lm = head.stage.module[1].lm.weight
    torch.testing.assert_close(lm, tied, rtol=0, atol=0)
    state = head.optimizer.state[lm]
    assert int(state["step"]) == 1
    torch.testing.assert_close(state["exp_avg"], whole.optimizer.state[tied]["exp_avg"], rtol=0, atol=0)


def tied_resume(d: Path) -> list[Case]:
    ck = d / "ck"
    common = ["--model", "gpt", "--model-args", json.dumps(GPT), "--microbatches", "4", "--microbatch-size", str(B),
              "--optimizer", "adam", "--lr", "0.01", "--dtype", "float64", "--device", "cpu", "--schedule", "1f1b",
              "--checkpoint-dir", str(ck), "--layers-per-stage", "even"]
    return [Case(1, [*common, "--steps", "2"]),
            Case(2, [*common, "--steps", "4", "--resume", "--save", str(d / "model.pt")])]


@batched(tied_resume)
def test_tied_weights_resume_under_another_split(mpi: MpiRun):
    """Checkpoint after 2 steps on one process, resume on two stages: 4 steps equal single-process training."""
    got = saved(mpi)
    assert_same(got, reference_flush("gpt", GPT, steps=4, microbatches=4, microbatch_size=B, optimizer="adam",
                                     lr=0.01))


# ------------------------------------------------------------------ item 6: sends released as they complete


def _send_peaks(stderr: str) -> dict[int, tuple[int, int, int]]:
    """rank -> (peak sends held, their bytes, window) from the engine's last `sends held` line."""
    out = {}
    for r, peak, nbytes, window in re.findall(r"\[rank (\d+)\] INFO pipeflow\.engine: sends held: peak (\d+) "
                                              r"\((\d+) bytes\), window (\d+)", stderr):
        out[int(r)] = (int(peak), int(nbytes), int(window))
    return out


def sends_held(d: Path) -> list[Case]:
    cases = []
    for m in (16, 32):
        plan = d / f"plan-m{m}.json"
        write_plan(plan, "1f1b", m, [(3, 1), (3, 1)])
        cases.append(Case(2, ["--model", "mlp", "--model-args", json.dumps(MLP), "--plan", str(plan), "--steps", "2",
                              "--microbatch-size", str(B), "--optimizer", "sgd", "--lr", "0.05", "--dtype", "float64",
                              "--device", "cpu"], env={"PIPEFLOW_LOG": "INFO"}))
    return cases


@batched(sends_held)
def test_sends_held_do_not_grow_with_microbatches(mpi: MpiRun):
    """1f1b on 2 stages: the sends a rank holds (Works and their buffers) are bounded by what the schedule
    keeps in flight, the same for m=16 and m=32 (before: every send of the step, 2m tensors, until STEP)."""
    peaks = {}
    for m, proc in zip((16, 32), mpi.procs):
        peaks[m] = _send_peaks(proc.stderr)
        assert sorted(peaks[m]) == [0, 1], proc.stderr
    # One send is (h, r): 2 tensors of B x hidden float64, the activations forward or their gradients back.
    per_send = 2 * B * MLP["hidden"] * 8
    for r in (0, 1):
        (p16, b16, w16), (p32, b32, w32) = peaks[16][r], peaks[32][r]
        assert w16 == w32 < 16, (r, w16, w32)
        assert p32 <= w32 and b32 <= w32 * per_send, (r, peaks)
        assert (p32, b32) == (p16, b16), (r, peaks)


# ------------------------------------------------------------------ item 7: async replicas average


def async_replicas(d: Path) -> Case:
    case = train(d, "mlp", MLP, [(6, 2)], schedule="async", m=2, steps=3,
                 extra=["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"])
    case.env["PIPEFLOW_REDUCE_INPLACE"] = "1"  # the mean taken in place (reduce.py)
    return case


@batched(async_replicas)
def test_async_data_parallel_replicas_average_their_gradients(mpi: MpiRun):
    """async on one stage of 2 replicas, m=2: each update takes microbatches 2u and 2u+1 on the weights of
    update u, so with the *mean* of the two gradients it is minibatch SGD with m=2 (a sum steps with 2 lr)."""
    got = saved(mpi)
    want = reference_flush("mlp", MLP, steps=3, microbatches=2, microbatch_size=B, optimizer="sgd", lr=0.05,
                           momentum=0.9)
    assert_same(got, want)
    delayed = reference_delayed("mlp", MLP, schedule="async", stages=[(6, 2)], steps=3, microbatches=2,
                                microbatch_size=B, optimizer="sgd", lr=0.05, momentum=0.9)
    assert_same(delayed, want)


# ------------------------------------------------------------------ the reducer in one process


# one_rank_group (tests/conftest.py): a gloo world of one in this process.


def test_reducer_launches_during_backward_only_what_is_final(one_rank_group):
    """Buckets of one parameter each. A plain backward launches every bucket during the backward (overlap),
    an unused parameter's as soon as the buckets before it are out (its gradient is final: none) and it
    keeps grad=None; a graph through reentrant checkpointing (nested backwards) launches nothing before
    finish(), nor one that reaches none of the parameters (a stashed copy's)."""
    from pipeflow.reduce import GradReducer
    from tests.models_grads import Twice

    torch.manual_seed(0)
    used, spare, out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
    params = [*used.parameters(), *spare.parameters(), *out.parameters()]
    red = GradReducer(params, one_rank_group, bucket_bytes=1)
    assert len(red.buckets) == 6
    loss = out(torch.tanh(used(torch.randn(3, 4)))).sum()
    red.arm([loss])
    assert red.works == []
    launched = []
    used.weight.register_post_accumulate_grad_hook(lambda p: launched.append(len(red.works)))
    loss.backward()
    # Reverse order: out.bias, out.weight, spare.bias, spare.weight, used.bias, used.weight (the last).
    assert launched == [6] and [b for _, _, b, _, _ in red.works] == [0, 1, 2, 3, 4, 5]  # all, in backward
    want = {id(p): None if p.grad is None else p.grad.clone() for p in params}
    red.finish()
    assert spare.weight.grad is None and spare.bias.grad is None
    for p in params:
        if want[id(p)] is not None:
            torch.testing.assert_close(p.grad, want[id(p)], rtol=0, atol=0)

    twice = Twice(4)
    red = GradReducer(list(twice.parameters()), one_rank_group, bucket_bytes=1)
    x = torch.randn(3, 4, requires_grad=True)
    loss = twice(x).sum()
    red.arm([loss])
    loss.backward()
    assert red.works == []
    ref = Twice(4)
    ref.load_state_dict(twice.state_dict())
    ref(x.detach().requires_grad_(True)).sum().backward()
    red.finish()
    for p, q in zip(twice.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)

    copy = nn.Linear(4, 2)  # stash.py: the forward ran on a copy, whose gradients reach .grad afterwards
    red = GradReducer(list(out.parameters()), one_rank_group, bucket_bytes=1)
    loss = copy(torch.randn(3, 4)).sum()
    red.arm([loss])
    loss.backward()
    assert red.works == []


def _across(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One microbatch's loss in one process, and through two stages cut before the last layer, stage 0's output
    crossing as separate tensors, as comm.P2P delivers them."""
    spec = build_model(f"tests.models_grads:{model}", SMALL, seed=0)
    x, y = MicrobatchLoader(spec.dataset, B, seed=0).microbatch(0)
    cpu = torch.device("cpu")
    first = Stage(spec.layers[:2], start=0, first=True, last=False, loss_fn=None, device=cpu, dtype=torch.float64)
    last = Stage(spec.layers[2:], start=2, first=False, last=True, loss_fn=spec.loss_fn, device=cpu,
                 dtype=torch.float64)
    want = spec.loss_fn(last.module(first.module(x.double())), y)
    sent = [t.detach().clone().requires_grad_(t.requires_grad) for t in first.forward(0, x)]
    return want, last.forward(0, sent, y, tree=first.trees[0])[0]


def test_tensors_sharing_memory_without_a_common_element_cross_apart_and_change_alone() -> None:
    """(h[:, :4], h[:, 4:]): the next stage scales the second half in place; in one process the first half is
    untouched too, so the two cross as separate tensors and nothing is refused."""
    want, got = _across("halves")
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)


def test_a_tensor_changed_in_place_where_another_sent_apart_shares_it_stops_in_one_line() -> None:
    """(h[:, ::2], h[:, :2]) share h's first column, and neither travels inside the other: the next stage scaled the
    second in place, which in one process changes the first's first column too. Sent apart, the first kept its values
    (the loss silently differed); now the receiving stage stops with one line (exit 2 under pipeflow-train)."""
    with pytest.raises(OutputError, match=r"^layer 2 \(ScaleSecond\) changed in place a received tensor \(leaf 1 of "
                                          r"the previous stage's output, depth first\) that shares memory there "
                                          r"with leaf 0; the two cross apart .* return a \.clone\(\) of one of them$"):
        _across("strided")
