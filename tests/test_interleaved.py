"""Many stages per rank and --schedule interleaved (issues 12 and 14): the IR with stages, validation and dry
run over a grid, plan.json's round-robin stages, the simulator's bubble, the planner's chunks, and equality
with single-process training under mpirun (float64, with and without replicas)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from partitioner.plan import Plan, PlanError, even_plan
from pipeflow.actions import Action, Kind
from pipeflow.kinds import schedule_kind
from pipeflow.schedule import ScheduleError, dry_run, from_lists, generate, validate
from tests.conftest import Case, MpiRun, batched
from tests.reference import reference_flush

# ---------------------------------------------------------------- the IR


def test_ir_round_trips_with_stages_and_names_the_stage_of_every_action():
    sched = generate("interleaved", 2, 4, (2, 1), virtual_stages=2)
    text = [[str(a) for a in acts] for acts in sched.actions]
    assert text[0][:4] == ["0F0", "0SEND_F0", "2RECV_F0", "0F2"]  # replica 0 of group 0: chunks 0 and 2
    again = from_lists("interleaved", 2, 4, text, (2, 1), virtual_stages=2)
    assert again.actions == sched.actions and all(Action.parse(x) == a for x, a in zip(text[2], sched.actions[2]))
    assert all(a.stage is not None for acts in sched.actions for a in acts if a.kind is not Kind.STEP)
    assert sched.render().splitlines()[0] == "interleaved S=2 v=2 m=4 replicas=[2, 1]"
    assert sched.model_stages == 4 and sched.chunks_of(2) == [1, 3]
    # chunk 1 sends to chunk 2 on group 0 (the last group wraps), to the replica owning the microbatch
    assert sched.peer(2, Action(Kind.SEND_F, 1, 1)) == 1 and sched.peer(0, Action(Kind.RECV_B, 2, 2)) == 2
    with pytest.raises(ScheduleError, match=r"^3SEND_F0 on stage 3 has no peer stage 4"):
        sched.peer(2, Action(Kind.SEND_F, 0, 3))


def _pairs(sched, w, kind):
    return [(a.stage, a.microbatch) for a in sched.actions[w] if a.kind is kind]


@pytest.mark.parametrize("S", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 3])
@pytest.mark.parametrize("reps", ["none", "first", "last", "all"])
def test_grid_generates_validates_and_dry_runs(S, v, rounds, reps):
    """Every chunk of every microbatch forward then backward once on the group k mod S, Megatron's order and
    warm-up without replicas, and no deadlock (generate validates and dry-runs)."""
    replicas = {"none": (1,) * S, "first": (2,) + (1,) * (S - 1), "last": (1,) * (S - 1) + (3,),
                "all": (2,) * S}[reps]
    m = S * rounds
    sched = generate("interleaved", S, m, replicas, virtual_stages=v)
    assert len(dry_run(sched)) == sum(len(a) for a in sched.actions)
    for w, (g, r) in enumerate(sched.workers):
        mine = [i for i in range(m) if i % replicas[g] == r]
        fs, bs = _pairs(sched, w, Kind.F), _pairs(sched, w, Kind.B)
        assert sorted(fs) == sorted(bs) == sorted((k, i) for k in range(g, S * v, S) for i in mine)
        if reps == "none":
            # Narayanan et al. §2.2: rounds of S microbatches through chunk 0, 1, ...; backwards last chunk first
            assert fs == [(g + c * S, i) for q in range(rounds) for c in range(v) for i in range(q * S, q * S + S)]
            assert bs == [(g + c * S, i) for q in range(rounds) for c in reversed(range(v))
                          for i in range(q * S, q * S + S)]
            computes = [a.kind for a in sched.actions[w] if a.is_compute]
            # warm-up forwards, then one forward and one backward in turn
            assert computes.index(Kind.B) == min(m * v, (v - 1) * S + 2 * (S - 1 - g) + 1)


def test_a_plain_schedule_refuses_virtual_stages():
    with pytest.raises(ScheduleError, match=r"^--virtual-stages applies to a schedule that places chunks "
                                            r"round-robin \(interleaved\), not '1f1b'$"):
        generate("1f1b", 2, 4, virtual_stages=2)


@pytest.mark.parametrize("m,reps,message", [
    (3, [1, 1], "interleaved needs at least 2 pipeline rank groups and --microbatches a multiple of their number "
                "(Megatron's interleaving), found 3 microbatches for 2 groups"),
    (4, [2], "interleaved needs at least 2 pipeline rank groups and --microbatches a multiple of their number "
             "(Megatron's interleaving), found 4 microbatches for 1 groups"),
])
def test_the_rule_on_m(m, reps, message):
    assert schedule_kind("interleaved").violation(m, reps) == message
    assert schedule_kind("interleaved").violation(4, [1, 1]) is None


def _lists(S=2, v=2, m=4, reps=(1, 1)):
    return [[str(a) for a in acts] for acts in generate("interleaved", S, m, reps, virtual_stages=v).actions]


def test_bad_interleaved_lists_are_refused_with_the_grid():
    good = _lists()
    # An action without its stage: the worker holds two stages, which one would it run on?
    bad = [list(x) for x in good]
    bad[0][0] = "F0"
    with pytest.raises(ScheduleError, match=r"^worker 0 runs F0 without a stage: with 2 virtual stages every action "
                                            r"names its stage \(e\.g\. 0F0\)") as e:
        from_lists("interleaved", 2, 4, bad, virtual_stages=2)
    assert "*F0*" in str(e.value) and "<-- ERROR HERE" in str(e.value)
    # A stage of the other group.
    bad = [list(x) for x in good]
    bad[0][0] = "1F0"
    with pytest.raises(ScheduleError, match=r"^worker 0 runs 1F0, but stage 1 is not one of its stages \[0, 2\] "
                                            r"\(stage k runs on group k mod 2\)"):
        from_lists("interleaved", 2, 4, bad, virtual_stages=2)
    # Two chunks' sends swapped on one channel: the receiver expects them the other way round.
    bad = [list(x) for x in good]
    i, j = bad[0].index("0SEND_F1"), bad[0].index("2SEND_F0")
    bad[0][i], bad[0][j] = "2SEND_F0", "0SEND_F1"
    with pytest.raises(ScheduleError, match=r"^worker 0 runs 2SEND_F0 before 2F0"):
        from_lists("interleaved", 2, 4, bad, virtual_stages=2)
    sched = generate("interleaved", 2, 4, virtual_stages=2)
    acts = sched.actions[1]
    i = next(k for k, a in enumerate(acts) if str(a) == "1RECV_F0")
    j = next(k for k, a in enumerate(acts) if str(a) == "1RECV_F1")
    acts[i], acts[j] = acts[j], acts[i]
    acts.insert(j + 1, acts.pop(next(k for k, a in enumerate(acts) if str(a) == "1F1")))
    with pytest.raises(ScheduleError, match=r"channel 0->1 \(F\): sends \[\(0, 0\), \(0, 1\).*\] but receives "
                                            r"\[\(0, 1\), \(0, 0\)"):
        validate(sched)
    # A backward of chunk 3 before its forward on the last group.
    bad = [list(x) for x in good]
    k3 = bad[1].index("3B0")
    bad[1].insert(0, bad[1].pop(k3))
    with pytest.raises(ScheduleError, match=r"^worker 1 runs 3B0 before 3F0"):
        from_lists("interleaved", 2, 4, bad, virtual_stages=2)
    # Valid, every channel in order, but deadlocking: group 1 waits for the gradient of chunk 1 before it
    # runs chunk 3, which that gradient needs.
    bad = [list(x) for x in good]
    bad[1].remove("1RECV_B0")
    bad[1].remove("1B0")
    at = bad[1].index("1SEND_F0") + 1
    bad[1][at:at] = ["1RECV_B0", "1B0"]
    with pytest.raises(ScheduleError, match=r"^deadlock: worker 0 at 2F1, worker 1 at 1B0 can never proceed") as e:
        from_lists("interleaved", 2, 4, bad, virtual_stages=2)
    assert "<-- ERROR HERE" in str(e.value)


# ---------------------------------------------------------------- plan.json


def _rr_plan(schedule="interleaved"):
    return {"format": "pipeflow.plan/1", "schedule": schedule, "microbatches": 4, "workers": 3,
            "stages": [{"layers": [0, 2], "replicas": 2, "ranks": [0, 1]}, {"layers": [2, 3], "ranks": [2]},
                       {"layers": [3, 5], "replicas": 2, "ranks": [0, 1]}, {"layers": [5, 6], "ranks": [2]}]}


def test_plan_with_round_robin_stages_is_read_for_interleaved():
    plan = Plan.from_json(_rr_plan())
    assert (plan.groups, plan.virtual_stages, plan.replicas) == (2, 2, [2, 1])
    assert plan.stage_of_rank(1) == (0, 1) and plan.stage_of_rank(2) == (1, 0)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.to_json() == plan.to_json() and again.virtual_stages == 2
    plan.validate(num_layers=6, world_size=3)
    # Every existing plan: one stage per group.
    one = even_plan(6, 3, schedule="1f1b", microbatches=4)
    assert (one.groups, one.virtual_stages, one.replicas) == (3, 1, [1, 1, 1])
    inter = even_plan(6, 2, schedule="interleaved", microbatches=4, virtual_stages=3)
    assert [(st.layers, st.ranks) for st in inter.stages] == [((k, k + 1), [k % 2]) for k in range(6)]
    assert inter.workers == 2 and inter.virtual_stages == 3
    with pytest.raises(PlanError, match=r"^cannot split 6 layers into 8 stages \(2 ranks x --virtual-stages 4\): "
                                        r"use fewer virtual stages or processes$"):
        even_plan(6, 2, schedule="interleaved", microbatches=4, virtual_stages=4)


def test_plan_with_repeated_ranks_is_refused_for_other_schedules_in_one_line():
    with pytest.raises(PlanError, match=r"^plan: plan lists ranks \[0, 1, 2\] more than once: stage k on the ranks of "
                                        r"stage k mod 2 places chunks round-robin, which only --schedule interleaved "
                                        r"runs, found '1f1b'$"):
        Plan.from_json(_rr_plan("1f1b"))
    # Repeated ranks in another pattern keep their message, whatever the schedule.
    d = _rr_plan()
    d["stages"][3]["ranks"] = [0]
    d["stages"][3]["replicas"] = 1
    with pytest.raises(PlanError, match=r"^plan: plan lists ranks \[0, 1\] more than once; every rank must appear "
                                        r"exactly once$"):
        Plan.from_json(d)


def _train_args(*argv):
    from pipeflow.train import build_parser

    return build_parser().parse_args(list(argv))


def test_train_flags_give_one_clear_line(tmp_path):
    """--virtual-stages and plans, checked before any process group (pipeflow/planning.py)."""
    from pipeflow.failure import UsageError
    from pipeflow.planning import make_plan
    from pipeflow.spec import build_model

    spec = build_model("mlp", {"layers": 6, "hidden": 8, "d_in": 4, "samples": 16}, seed=0)
    plan = make_plan(_train_args("--schedule", "interleaved", "--layers-per-stage", "even", "--microbatches", "4"),
                     spec, 2, 0, None)
    assert plan.virtual_stages == 2 and [st.ranks for st in plan.stages] == [[0], [1], [0], [1]]
    plan = make_plan(_train_args("--schedule", "interleaved", "--virtual-stages", "3", "--layers-per-stage",
                                 "1,1,1,1,1,1", "--microbatches", "2"), spec, 2, 0, None)
    assert plan.virtual_stages == 3
    # Checkpoints hold one file per model stage: several chunks per rank save and resume (test_checkpoint_interleaved).
    plan = make_plan(_train_args("--schedule", "interleaved", "--layers-per-stage", "even", "--microbatches", "4",
                                 "--checkpoint-dir", str(tmp_path), "--resume", "latest"), spec, 2, 0, None)
    assert plan.virtual_stages == 2
    cases = [
        (["--schedule", "1f1b", "--virtual-stages", "2", "--layers-per-stage", "even"],
         "--virtual-stages 2 needs a schedule that places chunks round-robin (interleaved), found --schedule 1f1b"),
        (["--schedule", "interleaved", "--virtual-stages", "0", "--layers-per-stage", "even"],
         "--virtual-stages must be >= 1, found 0"),
        (["--schedule", "interleaved", "--layers-per-stage", "even", "--microbatches", "3"],
         "interleaved needs at least 2 pipeline rank groups and --microbatches a multiple of their number "
         "(Megatron's interleaving), found 3 microbatches for 2 groups"),
        (["--schedule", "interleaved", "--layers-per-stage", "3,3"], "--layers-per-stage gives 2 stages but -np is "
                                                                       "2 x --virtual-stages 2"),
    ]
    for argv, message in cases:
        with pytest.raises(UsageError) as e:
            make_plan(_train_args(*argv), spec, 2, 0, None)
        assert str(e.value) == message
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_rr_plan()))
    with pytest.raises(PlanError) as e:
        make_plan(_train_args("--plan", str(path), "--schedule", "1f1b"), spec, 3, 0, None)
    assert str(e.value) == (f"{path}: plan lists ranks [0, 1, 2] more than once: stage k on the ranks of stage k mod "
                            "2 places chunks round-robin, which only --schedule interleaved runs, found '1f1b'")
    with pytest.raises(UsageError) as e:
        make_plan(_train_args("--plan", str(path), "--virtual-stages", "3"), spec, 3, 0, None)
    assert str(e.value) == (f"--virtual-stages 3 but {path} places 2 stage(s) on each rank group; drop the flag "
                            "or plan again")
    assert make_plan(_train_args("--plan", str(path)), spec, 3, 0, None).virtual_stages == 2


# ---------------------------------------------------------------- simulator and planner


@pytest.mark.parametrize("S,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 6), (4, 2, 16), (2, 3, 4)])
def test_simulated_bubble_is_the_papers(S, v, m):
    """Narayanan et al. SC'21 §2.2: on equal stages the bubble is (S-1)/(v m) of the ideal time (1F1B's (S-1)/m),
    and the simulator's bubble fraction is that bubble over the whole step."""
    from partitioner.simulate import StageCost, simulate

    f, b = 1.0, 2.0  # one rank's whole share of the model
    sim = simulate("interleaved", [StageCost(f / v, b / v) for _ in range(S * v)], None, m, virtual_stages=v)
    ideal = m * (f + b)
    assert sim.step_ms == pytest.approx(ideal * (1 + (S - 1) / (v * m)), rel=1e-12)
    assert sim.bubble_fraction == pytest.approx(1 - ideal / sim.step_ms, rel=1e-12)
    flat = simulate("1f1b", [StageCost(f, b) for _ in range(S)], None, m)
    assert flat.step_ms == pytest.approx(ideal * (1 + (S - 1) / m), rel=1e-12)
    assert sim.peak_in_flight == [min(m * v, (v - 1) * S + 2 * (S - 1 - k % S) + 1) for k in range(S * v)]


def test_planner_gives_balanced_chunks_round_robin(tmp_path):
    from partitioner.chunks import balanced_chunks
    from partitioner.profile import LayerProfile, Profile
    from partitioner.service import plan_detailed

    assert balanced_chunks([1, 1, 1, 1, 4, 1, 1], 3) == [(0, 4), (4, 5), (5, 7)]
    costs = [4.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 4.0]  # one split into 4 chunks of 4 (x 3: forward + backward)
    prof = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", c, 2 * c, 1000, 1000, 1000)
                                                  for i, c in enumerate(costs)])
    got = plan_detailed(prof, 2, schedule="interleaved", microbatches=4, virtual_stages=2)
    plan = got.plan
    assert [st.layers for st in plan.stages] == [(0, 1), (1, 4), (4, 7), (7, 8)]
    assert [st.ranks for st in plan.stages] == [[0], [1], [0], [1]] and plan.virtual_stages == 2
    assert plan.predicted["step_ms"] == pytest.approx(got.sim.step_ms) and got.sim.schedule.virtual_stages == 2
    from partitioner.service import evaluate_plan
    assert evaluate_plan(prof, plan).plan.predicted == plan.predicted  # a round-robin plan priced as written
    auto = plan_detailed(prof, 2, schedule="interleaved", microbatches="auto", virtual_stages=2).plan
    assert auto.microbatches % 2 == 0 and auto.predicted["bubble_fraction"] <= 0.10
    from partitioner.cli import main

    out = tmp_path / "plan.json"
    prof.save(tmp_path / "profile.json")
    assert main([str(tmp_path / "profile.json"), "--workers", "2", "--schedule", "interleaved", "--microbatches",
                 "4", "--virtual-stages", "2", "-o", str(out)]) == 0
    assert Plan.load(out).to_json()["stages"] == plan.to_json()["stages"]


# ---------------------------------------------------------------- under mpirun

MODELS = {"mlp": {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256},
          "gpt": {"layers": 4, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256}}
STEPS, B = 3, 2


def _args(d: Path, model: str, m: int) -> list[str]:
    return ["--model", model, "--model-args", json.dumps(MODELS[model]), "--steps", str(STEPS), "--microbatches",
            str(m), "--microbatch-size", str(B), "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
            "--dtype", "float64", "--device", "cpu", "--save", str(d / "model.pt")]


def interleaved_run(d: Path, model: str, layout: str) -> Case:
    if layout == "replicas":  # 2 rank groups, replicas [2, 1], 2 chunks each; ranks of group 0 hold 0 and 2
        d.mkdir(parents=True, exist_ok=True)
        plan = _rr_plan()
        (d / "plan.json").write_text(json.dumps(plan))
        return Case(3, ["--plan", str(d / "plan.json"), *_args(d, model, 4)])
    np_, v = {"np2": (2, 2), "np3": (3, 2)}[layout]
    return Case(np_, ["--schedule", "interleaved", "--virtual-stages", str(v), "--layers-per-stage", "even",
                      *_args(d, model, 2 * np_)])


@pytest.mark.parametrize("model,layout", [("mlp", "np2"), ("gpt", "np2"), ("gpt", "np3"), ("gpt", "replicas"),
                                          ("mlp", "replicas")])
@batched(interleaved_run)
def test_interleaved_equals_single_process(mpi: MpiRun, model, layout):
    """Each rank runs its chunks' actions; the tied embedding and head of gpt (chunk 0 and the last chunk)
    sum their gradients; replicas reduce per chunk. Parameters equal one process's, key order included."""
    m = {"np2": 4, "np3": 6, "replicas": 4}[layout]
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush(model, MODELS[model], steps=STEPS, microbatches=m, microbatch_size=B, optimizer="sgd",
                           lr=0.05, momentum=0.9)
    initial = reference_flush(model, MODELS[model], steps=0, microbatches=m, microbatch_size=B)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)
    assert any(not torch.equal(want[k], initial[k]) for k in want)


def device_wait_run(d: Path, schedule: str) -> Case:
    flags = ["--virtual-stages", "2"] if schedule == "interleaved" else []
    return Case(2, ["--schedule", schedule, *flags, "--layers-per-stage", "even", *_args(d, "gpt", 4)],
                main="tests.device_sync:main", timeout=60)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h2", "interleaved"])
@batched(device_wait_run)
def test_a_first_launch_that_waits_for_posted_receives_does_not_hang(mpi: MpiRun, schedule):
    """On 2 H100s interleaved hung in its first step: rank 0 posted the receive of chunk 2's input ahead of
    its use and blocked its host there for the shapes, which rank 1 sends after its first forward; rank 1's
    first forward waited for every receive it had posted (a GPU's first cuBLAS use does), among them one that
    rank 0 sends only after those shapes. tests/device_sync.py emulates that wait on CPU; the run must finish
    with one process's parameters."""
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("gpt", MODELS["gpt"], steps=STEPS, microbatches=4, microbatch_size=B, optimizer="sgd",
                           lr=0.05, momentum=0.9)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)


def test_argparse_namespace_has_the_flag():
    args = _train_args("--virtual-stages", "2")
    assert isinstance(args, argparse.Namespace) and args.virtual_stages == 2


def interleaved_bad_setups(d: Path) -> list[Case]:
    d.mkdir(parents=True, exist_ok=True)
    (d / "plan.json").write_text(json.dumps(_rr_plan()))
    # -np 2 first: the batched runner runs the -np groups in one order for every test (conftest.Batches).
    return [Case(2, ["--schedule", "interleaved", "--layers-per-stage", "even", *_args(d, "mlp", 3)], check=False),
            Case(3, ["--plan", str(d / "plan.json"), "--schedule", "1f1b", *_args(d, "mlp", 4)], check=False)]


@batched(interleaved_bad_setups)
def test_interleaved_bad_setups_print_one_line_and_exit_2(mpi: MpiRun):
    """Under mpirun: a round-robin plan under another schedule, and m not a multiple of the ranks, stop at
    set-up on every rank with one line from rank 0, exit 2."""
    path = mpi.dir / "plan.json"
    for proc, want in zip(mpi.procs, [
            "pipeflow-train: error: interleaved needs at least 2 pipeline rank groups and --microbatches a multiple "
            "of their number (Megatron's interleaving), found 3 microbatches for 2 groups",
            f"pipeflow-train: error: {path}: plan lists ranks [0, 1, 2] more than once: stage k on the ranks of "
            "stage k mod 2 places chunks round-robin, which only --schedule interleaved runs, found '1f1b'"]):
        lines = [line for line in proc.stderr.splitlines() if "pipeflow-train" in line]
        assert proc.returncode == 2 and lines == [want], proc.stderr
        assert "Traceback" not in proc.stderr and "[rank" not in proc.stderr
