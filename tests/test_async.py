"""async (weight stashing, vertical sync) and 2bw: versions held; mpirun runs equal the delayed-update reference."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeflow.schedule import ScheduleError, generate
from pipeflow.stash import StashPolicy, VersionBook, simulate, version_fn
from tests.conftest import Case, MpiRun, batched, write_plan
from tests.reference import reference_delayed, reference_flush, weight_versions

MODELS = {"mlp": {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256},
          "gpt": {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256}}
# gpt's fine layers (embedding, 2 x (AttentionCore, Projection, Expand, Contract), head): boundaries inside a
# sublayer carry two tensors, the residual and the branch, through the stashed weight copies.
MODELS["gpt-fine"] = {**MODELS["gpt"], "granularity": "fine"}
BUILDER = {"gpt-fine": "gpt"}
B = 2

# ---------------------------------------------------------------- pure: versions held


def required(actions, version):
    """Brute force: at each point of the list, the versions that must exist apart from the live weights:
    those of microbatches in flight across a STEP, and older-than-live ones that later forwards use."""
    pos = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
    steps_before = [sum(b.kind == "STEP" for b in actions[:i]) for i in range(len(actions) + 1)]
    mbs = [a.microbatch for a in actions if a.kind == "F"]
    peak = 0
    for p in range(len(actions) + 1):
        live = steps_before[p]
        need = set()
        for t in mbs:
            f, b = pos[("F", t)], pos[("B", t)]
            crossing = steps_before[b] > steps_before[f] or version(t) < steps_before[f]
            if f < p <= b and crossing:
                need.add(version(t))
            if p <= f and version(t) < live:
                need.add(version(t))
        peak = max(peak, len(need))
    return peak


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_async_stash_holds_the_versions_in_flight(n):
    # PipeDream §3.3: stage j (1..n) has n - j + 1 microbatches in flight, each on its own version; the
    # last stage's backward follows its forward with no update between, so it runs on the live weights.
    sched = generate("async", n, 4 * n + 3, minibatch=1)
    for w in range(n):
        v = version_fn(sched, w, minibatch=1)
        assert [v(t) for t in range(6)] == [max(0, t - n + w + 1) for t in range(6)]
        assert simulate(sched.actions[w], v) == required(sched.actions[w], v) == (n - w if w < n - 1 else 0)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_vertical_sync_and_2bw_versions(n):
    sched = generate("async", n, 4 * n + 3, minibatch=1)
    for w in range(n):
        v = version_fn(sched, w, minibatch=1, vertical_sync=True)
        assert [v(t) for t in range(8)] == [max(0, t - n + 1) for t in range(8)]
        assert simulate(sched.actions[w], v) == required(sched.actions[w], v) <= n
    for m in (n - 1, n, n + 2):  # PipeDream-2BW: two versions (m >= stages - 1 microbatches per minibatch)
        sched = generate("2bw", n, 4 * m, minibatch=m)
        for w in range(n):
            v = version_fn(sched, w, minibatch=m)
            assert simulate(sched.actions[w], v) == required(sched.actions[w], v) <= 2


@pytest.mark.parametrize("reps", [(2, 1, 1), (1, 2), (1, 3), (2, 2), (3, 1), (1, 2, 1)])
@pytest.mark.parametrize("kind", ["async", "vsync", "2bw"])
def test_replicated_versions_are_minimal_and_match_the_reference(reps, kind):
    m = 4 if kind == "2bw" else 6
    sched = generate("2bw" if kind == "2bw" else "async", len(reps), 24, reps, minibatch=m)
    ref = weight_versions(sched.name, list(reps), minibatch=m, vertical_sync=kind == "vsync")
    for w in range(len(sched.workers)):
        s = sched.stage_of(w)
        v = version_fn(sched, s, minibatch=m, vertical_sync=kind == "vsync")
        assert [v(t) for t in range(24)] == [ref[s](t) for t in range(24)]
        # VersionBook raises if a forward needs a version its worker has not made yet.
        assert simulate(sched.actions[w], v) == required(sched.actions[w], v)


def test_2bw_needs_enough_microbatches_per_minibatch():
    with pytest.raises(ScheduleError, match=r"^2bw: stage 0 has 1 replica\(s\) and 3 warm-up forward\(s\), more than "
                                            r"its share of a minibatch of 2 microbatches \(two weight versions\)$"):
        generate("2bw", 4, 8, minibatch=2)
    sched = generate("1f1b", 4, 8)  # the book itself still marks where a list needs a version not made yet
    with pytest.raises(ScheduleError, match="ERROR HERE"):
        VersionBook(sched.actions[0], lambda t: max(0, t // 2 - 1), sched=sched, worker=0)
    with pytest.raises(ScheduleError, match="replicas"):
        generate("2bw", 2, 8, (3, 1), minibatch=2)
    with pytest.raises(ScheduleError, match="divide"):
        generate("async", 2, 9, (2, 1), minibatch=9)
    with pytest.raises(ScheduleError, match="m=5"):
        version_fn(generate("async", 2, 10, (2, 1), minibatch=5), 0, minibatch=5)


def test_updating_weights_a_graph_saved_raises():
    """Why copies: a step between a forward and its backward on the same tensors is an in-place change
    that autograd's version counters catch (PipeDream's param.data swaps escaped this check)."""
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.randn(4, 3)).sum().backward()
    out = net(torch.randn(4, 3, requires_grad=True)).sum()  # saves the weight for the input's gradient
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_stash_policy_in_one_process():
    """Stage 0 of a 3-stage async pipeline, downstream replaced by fixed output gradients: the policy's
    updates equal the delayed rule, copies come from a pool of `simulate` buffers, and no tensor that a
    graph saved is modified in place (autograd's version counters would raise)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    ref = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    ref.load_state_dict(net.state_dict())
    live_params = list(net.parameters())
    sched = generate("async", 3, 12, minibatch=1)
    acts = sched.actions[0]
    v = version_fn(sched, 0, minibatch=1)
    policy = StashPolicy(net, acts, v)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    xs = [torch.randn(5, 3, dtype=torch.float64) for _ in range(12)]
    gs = [torch.randn(5, 2, dtype=torch.float64) for _ in range(12)]
    outs = {}
    for a in acts:
        if a.kind == "F":
            policy.before_forward(a.microbatch)
            outs[a.microbatch] = net(xs[a.microbatch])
            policy.after_forward(a.microbatch)
        elif a.kind == "B":
            policy.before_backward(a.microbatch)
            outs.pop(a.microbatch).backward(gs[a.microbatch])
            policy.after_backward(a.microbatch)
        elif a.kind == "STEP":
            policy.before_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            policy.after_step()
    assert list(net.parameters()) == live_params  # the module is bound to its own parameters again
    assert policy.allocated == policy.book.peak == simulate(acts, v) == 3
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    history = [{k: p.detach().clone() for k, p in ref.named_parameters()}]
    for t in range(12):
        w = {k: p.clone().requires_grad_(True) for k, p in history[v(t)].items()}
        torch.func.functional_call(ref, w, (xs[t],)).backward(gs[t])
        for k, p in ref.named_parameters():
            p.grad = w[k].grad
        ref_opt.step()
        history.append({k: p.detach().clone() for k, p in ref.named_parameters()})
    for (k, p), q in zip(ref.named_parameters(), net.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14, msg=k)


# ---------------------------------------------------------------- under mpirun


# (model, schedule, stages [(layers, replicas)], m, steps, optimizer): 8 to 10 microbatches each.
CASES = {
    "async-mlp-np2": ("mlp", "async", [(3, 1), (3, 1)], 5, 2, "sgd"),
    "async-gpt-np4": ("gpt", "async", [(1, 1)] * 4, 5, 2, "sgd"),
    "vsync-mlp-np4": ("mlp", "vsync", [(2, 1), (2, 1), (1, 1), (1, 1)], 5, 2, "sgd"),
    "2bw-gpt-np2": ("gpt", "2bw", [(2, 1), (2, 1)], 5, 2, "sgd"),
    "2bw-mlp-np4-adam": ("mlp", "2bw", [(2, 1), (2, 1), (1, 1), (1, 1)], 5, 2, "adam"),
    "async-mlp-2-1-1": ("mlp", "async", [(2, 2), (2, 1), (2, 1)], 2, 5, "sgd"),
    "vsync-mlp-1-2-1": ("mlp", "vsync", [(2, 1), (2, 2), (2, 1)], 2, 5, "sgd"),
    "async-mlp-dp2": ("mlp", "async", [(6, 2)], 4, 2, "sgd"),  # m=2 would be minibatch SGD (test_seams_grads)
    "2bw-mlp-1-3": ("mlp", "2bw", [(2, 1), (4, 3)], 5, 2, "sgd"),
    "2bw-gpt-1-2": ("gpt", "2bw", [(3, 1), (1, 2)], 5, 2, "sgd"),
    "2bw-mlp-warmup": ("mlp", "2bw", [(2, 1), (2, 1), (2, 1)], 4, 3, "adam"),
    "async-gptfine-np3": ("gpt-fine", "async", [(2, 1), (2, 1), (6, 1)], 5, 2, "sgd"),  # cut after AttentionCore
    "2bw-gptfine-np2": ("gpt-fine", "2bw", [(4, 1), (6, 1)], 5, 2, "adam"),  # and after Expand (4 x wide)
}
WARMUP = {"2bw-mlp-warmup": "4,2,0"}  # --warmup: deeper than 2bw's own 2,1,0; versions per minibatch, same result
LATE = {"2bw-mlp-1-3": ["1", "2", "3"]}  # the ranks of a replicated last stage: the all-reduce under the next minibatch


def delayed(d: Path, case: str) -> Case:
    model, schedule, stages, m, steps, opt = CASES[case]
    vsync = schedule == "vsync"
    schedule = "async" if vsync else schedule
    plan = d / "plan.json"
    np_ = write_plan(plan, schedule, m, stages)
    lr = 0.05 if opt == "sgd" else 0.01
    return Case(np_, ["--model", BUILDER.get(model, model), "--model-args", json.dumps(MODELS[model]),
                      "--plan", str(plan), "--steps", str(steps), "--microbatch-size", str(B), "--optimizer", opt,
                      "--lr", str(lr),
                      "--momentum", "0.9" if opt == "sgd" else "0", "--dtype", "float64", "--device", "cpu",
                      "--save", str(d / "model.pt")] + (["--vertical-sync"] if vsync else [])
                + (["--warmup", WARMUP[case]] if case in WARMUP else []),
                env={"PIPEFLOW_LOG": "INFO"} if case in WARMUP or case in LATE else {})


@pytest.mark.parametrize("case", list(CASES))
@batched(delayed)
def test_async_equals_delayed_reference(mpi: MpiRun, case):
    model, schedule, stages, m, steps, opt = CASES[case]
    vsync = schedule == "vsync"
    schedule = "async" if vsync else schedule
    lr = 0.05 if opt == "sgd" else 0.01
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    kw = dict(steps=steps, microbatches=m, microbatch_size=B, optimizer=opt, lr=lr,
              momentum=0.9 if opt == "sgd" else 0.0)
    want = reference_delayed(BUILDER.get(model, model), MODELS[model], schedule=schedule, stages=stages,
                             vertical_sync=vsync, **kw)
    assert list(got) == list(want), case
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=f"{case}: {k}")
    # The delayed rule matters here: the result differs from flush training on the same samples.
    flush = reference_flush(BUILDER.get(model, model), MODELS[model], **kw)
    assert any(not torch.allclose(want[k], flush[k], rtol=1e-6, atol=1e-8) for k in want)
    if case in LATE:  # each gradient's all-reduce completed at the next STEP (pipeflow/update.py), none on stage 0
        assert sorted(re.findall(r"\[rank (\d)\] INFO pipeflow.update: each update applied one STEP late on the live "
                                 r"weights: no weight copies; the replicas' all-reduce under the next minibatch",
                                 mpi.proc.stderr)) == LATE[case], mpi.proc.stderr
    if case in WARMUP:  # it ran the deeper warm-up, with the copies the memory model counts (2, 2, 0)
        assert f"2bw warm-up: {WARMUP[case].replace(',', ', ')} forwards" in mpi.proc.stderr
        held = sorted(re.findall(r"\[rank (\d)\] INFO pipeflow.stash: stash peak: \d+ bytes, (\d) versions",
                                 mpi.proc.stderr))
        assert held == [("0", "2"), ("1", "2")], held
        # the last stage holds no copy: its updates are deferred a STEP (pipeflow/update.py; before, one copy)
        assert re.findall(r"\[rank (\d)\] INFO pipeflow.update: each update applied one STEP late",
                          mpi.proc.stderr) == ["2"]
