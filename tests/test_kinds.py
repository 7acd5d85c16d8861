"""The schedule kind table drives behaviour, and no module outside it compares schedule names (pure)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from pipeflow.actions import KINDS, Action, Kind
from pipeflow.kinds import SCHEDULES, TABLE, InFlight, ScheduleKind, Weights, schedule_kind
from pipeflow.schedule import ScheduleError, generate

ROOT = Path(__file__).resolve().parents[1]
GRIDS = [(1, 1, (1,)), (2, 4, (1, 1)), (3, 4, (1, 1, 1)), (3, 6, (2, 1, 1)), (2, 6, (1, 3)), (4, 8, (2, 2, 1, 1)),
         (4, 3, (1, 1, 1, 1))]


def _runs(kind: ScheduleKind, S: int, m: int, reps: tuple[int, ...]) -> bool:
    return kind.violation(m, reps) is None


def _lists(kind: ScheduleKind, S: int, m: int, reps: tuple[int, ...], minibatches: int = 3):
    """The generated schedule: one minibatch for flush kinds, `minibatches` of them otherwise."""
    total = m if kind.flush else m * minibatches
    return generate(kind.name, S, total, reps, minibatch=m)


def test_table_names_and_lookup():
    assert SCHEDULES == ("gpipe", "1f1b", "async", "2bw", "interleaved", "zb", "zb-h2") == tuple(k.name for k in TABLE)
    for k in TABLE:
        assert schedule_kind(k.name) is k
    with pytest.raises(ScheduleError, match=r"^unknown schedule 'zb-h3'; expected one of gpipe, 1f1b, async, 2bw, "
                                            r"interleaved, zb, zb-h2$"):
        schedule_kind("zb-h3")
    import partitioner.planner
    import pipeflow.schedule
    assert pipeflow.schedule.SCHEDULES is SCHEDULES and partitioner.planner.SCHEDULES is SCHEDULES


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("S,m,reps", GRIDS)
def test_generator_of_each_kind_passes_validation_and_steps_as_the_record_says(name, S, m, reps):
    """generate() validates and dry-runs; the STEPs then consume the microbatches the record gives per update."""
    kind = schedule_kind(name)
    if not _runs(kind, S, m, reps):
        pytest.skip("the kind's rules exclude this grid (tested below)")
    sched = _lists(kind, S, m, reps)
    for s in range(S):
        # Between consecutive STEPs, the backwards of all replicas of stage s: one update's microbatches.
        per_update: list[int] = []
        for r in range(reps[s]):
            count, k = 0, 0
            for a in sched.actions[sched.worker(s, r)]:
                if a.kind is Kind.B:
                    count += 1
                elif a.kind is Kind.STEP:
                    if k == len(per_update):
                        per_update.append(0)
                    per_update[k] += count
                    count, k = 0, k + 1
            assert count == 0, "backwards after the last STEP"
        assert per_update == [kind.microbatches_per_update(m, reps[s])] * len(per_update)
        assert len(per_update) * kind.microbatches_per_update(m, reps[s]) == sched.microbatches
        if kind.flush:
            assert len(per_update) == 1


@pytest.mark.parametrize("name,scale,per_update,mean", [
    ("gpipe", 1 / 4, 4, False), ("1f1b", 1 / 4, 4, False), ("async", 1.0, 2, True), ("2bw", 1 / 4, 4, False)])
def test_loss_scale_and_microbatches_per_update(name, scale, per_update, mean):
    kind = schedule_kind(name)
    assert kind.loss_scale(4) == scale
    assert kind.microbatches_per_update(4, 2) == per_update
    assert kind.mean_over_replicas is mean


@pytest.mark.parametrize("S,m,reps", [(3, 6, (1, 1, 1)), (3, 6, (1, 2, 1)), (2, 8, (1, 1))])
def test_in_flight_rule_matches_the_generated_lists(S, m, reps):
    """The record's in-flight rule (the planner's memory model) is the generated lists' peak F-B count (F-W
    where the backward is split: the activations a W needs live until it runs)."""
    from pipeflow.kinds import warmup_forwards, zero_bubble_limit

    for kind in TABLE:
        sched = _lists(kind, S, m, reps)
        release = Kind.W if kind.split_backward else Kind.B
        for w, (s, _) in enumerate(sched.workers):
            held = peak = 0
            for a in sched.actions[w]:
                held += (a.kind is Kind.F) - (a.kind is release)
                peak = max(peak, held)
            local = len([i for i in range(m) if i % reps[s] == w - sched.worker(s, 0)])
            fill = warmup_forwards(reps, s) + 1
            most = max(min(warmup_forwards(reps, t) + 1, -(-m // r)) for t, r in enumerate(reps))
            zb = min(zero_bubble_limit(kind.in_flight, sum(reps), reps[s], most), local)
            want = {InFlight.ALL: local, InFlight.FILL_UP_TO_ALL: min(fill, local), InFlight.FILL: fill,
                    InFlight.INTERLEAVED: min(2 * fill - 1, local), InFlight.PIPELINE: zb,
                    InFlight.TWICE_PIPELINE: zb}[kind.in_flight]
            assert peak == want, (kind.name, w)


def test_stashed_versions_and_weights():
    assert [schedule_kind(n).weights for n in SCHEDULES] == [Weights.LIVE, Weights.LIVE, Weights.STASH,
                                                             Weights.DOUBLE_BUFFER, Weights.LIVE, Weights.LIVE,
                                                             Weights.LIVE]
    assert [schedule_kind(n).stashed_versions(5) for n in SCHEDULES] == [0, 0, 5, 2, 0, 0, 0]
    assert [schedule_kind(n).stashed_versions(1) for n in SCHEDULES] == [0, 0, 0, 1, 0, 0, 0]
    assert [schedule_kind(n).vertical_sync for n in SCHEDULES] == [False, False, True, False, False, False, False]
    from pipeflow.stash import version_fn
    for name in SCHEDULES:
        sched = generate(name, 2, 4, minibatch=2)
        if schedule_kind(name).weights is Weights.LIVE:
            with pytest.raises(ScheduleError, match=f"weight versions are for async and 2bw, found schedule '{name}'"):
                version_fn(sched, 0, minibatch=2)
        else:
            assert version_fn(sched, 0, minibatch=2)(0) == 0


@pytest.mark.parametrize("name", SCHEDULES)
def test_warmup_applies_only_where_the_record_says(name):
    kind = schedule_kind(name)
    if kind.warmup_applies:
        sched = generate(name, 3, 6, minibatch=6, warmup=[4, 3, 0])
        # warm-up 4, then F4 before B0 (1F1B's steady state)
        assert [a.kind for a in sched.actions[0] if a.is_compute][:6] == [Kind.F] * 5 + [Kind.B]
    else:
        with pytest.raises(ScheduleError, match=f"a warm-up depth applies to 1f1b and 2bw only, not '{name}'"):
            generate(name, 3, 6, minibatch=6, warmup=[4, 3, 0])


def test_flush_kinds_allow_ties_and_agree_every_step():
    for kind in TABLE:
        assert kind.ties_allowed is kind.flush and kind.agree_every_step is kind.flush


@pytest.mark.parametrize("name,m,reps,message", [
    ("async", 4, [1, 3], "async needs every stage's replica count to divide the microbatches per step, found "
                         "replicas [1, 3] and --microbatches 4"),
    ("2bw", 2, [3, 1], "2bw needs --microbatches >= every stage's replica count, found 2 < 3"),
    ("2bw", 2, [1, 1, 1, 1], "2bw needs every replica's share of a minibatch (--microbatches // replicas) to cover "
                             "its warm-up forwards (two weight versions), found stage 0 with 1 replica(s) and 3 "
                             "warm-up forward(s) at 2 microbatches (m >= stages - 1 without replicas)"),
    ("2bw", 2, [1, 1, 2], "2bw needs every replica's share of a minibatch (--microbatches // replicas) to cover its "
                          "warm-up forwards (two weight versions), found stage 0 with 1 replica(s) and 3 warm-up "
                          "forward(s) at 2 microbatches"),
])
def test_constraints_on_m_and_replicas(name, m, reps, message):
    assert schedule_kind(name).violation(m, reps) == message
    assert schedule_kind("1f1b").violation(m, reps) is None and schedule_kind("gpipe").violation(m, reps) is None
    from partitioner.price import schedule_rule
    assert schedule_rule(name, m, reps) == message


def test_rule_text_for_the_planner():
    assert [schedule_kind(n).rule for n in SCHEDULES] == [
        "", "", "every stage's replica count must divide m",
        "m >= every stage's replica count and m // replicas >= warm-up forwards on every stage (m >= stages - 1 "
        "without replicas)",
        "m a multiple of the pipeline's rank groups (at least 2)", "", ""]


def test_generators_enforce_what_they_need():
    with pytest.raises(ScheduleError, match="async: stage 1 has 3 replicas, which must divide"):
        generate("async", 2, 4, (1, 3), minibatch=4)
    with pytest.raises(ScheduleError, match="2bw: stage 0 has 3 replicas and minibatches of 2"):
        generate("2bw", 2, 4, (3, 1), minibatch=2)


def test_action_kinds_are_an_enum_and_round_trip():
    assert KINDS == tuple(k.value for k in Kind) == ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "STEP")
    for k in Kind:
        for text in ([f"{k}", f"2{k}"] if k is Kind.STEP else [f"{k}3", f"1{k}3", f"{k}12"]):
            a = Action.parse(text)
            assert str(a) == text and a.kind is k and Action.parse(str(a)) == a
    assert Action("SEND_B", 3) == Action(Kind.SEND_B, 3) and Action("F", 1).kind is Kind.F
    assert str(Action(Kind.F, 3, 1)) == "1F3" and f"{Kind.RECV_F}" == "RECV_F" and Kind.B == "B"
    with pytest.raises(ValueError, match=r"unknown action kind 'X'; expected one of \('F', 'B', 'W'"):
        Action("X", 1)
    with pytest.raises(ValueError, match="STEP takes no microbatch"):
        Action(Kind.STEP, 1)


def test_dead_code_is_gone():
    from pipeflow.comm import World
    from pipeflow.hooks import WeightPolicy
    from pipeflow.schedule import Schedule, compute_order
    assert not hasattr(World, "barrier") and not hasattr(Schedule, "format_lists")
    assert not hasattr(WeightPolicy, "extra_state") and not hasattr(WeightPolicy, "load_extra_state")
    assert "stages" not in inspect.signature(compute_order).parameters


# ---------------------------------------------------------------- no module compares schedule names

ALLOWED = {"pipeflow/kinds.py"}  # the table itself


def _name_comparisons(path: Path, label: str) -> list[str]:
    """`x == "async"`, `x in ("gpipe", "1f1b")`, `{"async": ...}.get(x)`, FLUSH_SCHEDULES: a schedule's rule
    written outside the table. Defaults (`schedule="1f1b"`) and help text are not comparisons."""
    names = set(SCHEDULES)
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def named(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(x) for x in [node.left, *node.comparators]):
            found.append(f"{label}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict) and any(k is not None and named(k) for k in node.keys):
            found.append(f"{label}:{node.lineno}: a dict keyed by schedule names")
        elif isinstance(node, ast.Name) and node.id in ("FLUSH_SCHEDULES", "FLUSH"):
            found.append(f"{label}:{node.lineno}: {node.id}")
    return found


def test_no_module_outside_the_table_compares_schedule_names():
    files = sorted(p for d in ("pipeflow", "partitioner", "launch") for p in (ROOT / d).rglob("*.py"))
    assert any(p.name == "engine.py" for p in files)
    found = [f for p in files if (label := str(p.relative_to(ROOT))) not in ALLOWED
             for f in _name_comparisons(p, label)]
    assert found == [], "schedule rules belong in pipeflow/kinds.py:\n" + "\n".join(found)


def test_the_name_check_catches_a_comparison(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text('def f(s, t="1f1b"):\n    return 1.0 if s != "async" else {"2bw": 1}.get(s, 0)\n'
                   'def g(s):\n    return s in ("gpipe", "1f1b") or FLUSH_SCHEDULES\n')
    assert sorted(x.split(": ", 1)[1] for x in _name_comparisons(bad, "probe.py")) == [
        "FLUSH_SCHEDULES", "a dict keyed by schedule names", "s != 'async'", "s in ('gpipe', '1f1b')"]


def test_the_table_and_the_ir_are_pure():
    """The schedule table, the IR and the planner load without torch or mpi4py (pipeflow-plan's import path)."""
    import subprocess
    import sys

    code = ("import sys, pipeflow.kinds, pipeflow.actions, pipeflow.schedule, partitioner.planner; "
            "print(sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def _held_copies(sched, m: int) -> list[int | None]:
    """Per worker: the most weight copies the runtime's VersionBook holds, None where it refuses the list; a
    worker whose updates are deferred (pipeflow/update.py) holds no copy but one gradient, the bytes of one."""
    from pipeflow.stash import defers_update, simulate, version_fn

    out: list[int | None] = []
    for w in range(len(sched.workers)):
        try:
            version = version_fn(sched, sched.stage_of(w), minibatch=m)
            out.append(1 if defers_update(sched.actions[w], version) else simulate(sched.actions[w], version))
        except ScheduleError:
            out.append(None)
    return out


def test_2bw_rule_and_copies_are_the_runtime_s():
    """2bw's constraint (violation, the planner's) accepts exactly the stages, m and warm-ups whose action lists
    the runtime's VersionBook can run over many minibatches, and the memory model's copies are the most it
    holds. Before: m >= S - 1 passed 3 stages (1, 1, 2) at m = 2, which pipeflow-train then refused, and the
    model counted one copy where the runtime holds two."""
    import itertools

    from pipeflow.warmup import least_warmups

    kind = schedule_kind("2bw")
    for S in (1, 2, 3):
        for reps in itertools.product((1, 2, 3), repeat=S):
            for m in range(max(reps), 7):
                for extra in (0, 1, 2):
                    warm = [w + (extra if s < S - 1 else 0) for s, w in enumerate(least_warmups(reps))]
                    why = kind.violation(m, reps, warm)
                    try:  # the generator refuses what violates the rule, before any runtime
                        sched = generate("2bw", S, 10 * m, reps, minibatch=m, warmup=warm)
                    except ScheduleError as e:
                        assert why is not None or "deadlock" in str(e), (reps, m, warm, str(e))
                        continue
                    held = _held_copies(sched, m)
                    assert why is None and None not in held, (reps, m, warm, why, held)
                    fill = [w + 1 for w in warm]
                    assert held == [kind.stashed_versions(fill[sched.stage_of(w)]) for w in range(len(held))]


def test_async_copies_bound_the_runtime_s():
    """async's modelled copies are at least the runtime's, and none where it holds none (the last stage)."""
    import itertools

    kind = schedule_kind("async")
    for S in (1, 2, 3):
        for reps in itertools.product((1, 2), repeat=S):
            for m in range(1, 7):
                if kind.violation(m, reps) is not None:
                    continue
                sched = generate("async", S, 6 * m, reps, minibatch=m)
                held = _held_copies(sched, m)
                fill = [-(-sum(reps[s:]) // reps[s]) for s in range(S)]  # warm-up forwards + 1
                for w, h in enumerate(held):
                    model = kind.stashed_versions(fill[sched.stage_of(w)])
                    assert h is not None and h <= model and (h == 0) == (model == 0), (reps, m, w, h, model)


def _copies_per_update(sched, m: int) -> list[float]:
    """Per worker, the weight copies its VersionBook takes per STEP over the middle third of its list (the steady
    state; a segment's first minibatches and its drain copy less)."""
    from pipeflow.stash import VersionBook, defers_update, version_fn

    out = []
    for w, actions in enumerate(sched.actions):
        version = version_fn(sched, sched.stage_of(w), minibatch=m)
        if defers_update(actions, version):  # the engine's choice: no copies (pipeflow/update.py)
            out.append(0.0)
            continue
        book = VersionBook(actions, version, sched=sched, worker=w)
        takes: list[int] = []  # copies taken up to each STEP
        count = 0
        for a in actions:
            if a.kind is Kind.F:
                count += book.forward(a.microbatch)[2]
            elif a.kind is Kind.B:
                book.backward(a.microbatch)
            elif a.kind is Kind.STEP:
                count += book.step() is not None
                takes.append(count)
        a, b = len(takes) // 3, 2 * len(takes) // 3
        out.append((takes[b] - takes[a]) / (b - a))
    return out


@pytest.mark.parametrize("name", ["async", "2bw", "1f1b"])
def test_copies_per_update_are_the_runtime_s(name):
    """The cost model's weight copies per update (priced at the profile's copy_ms_per_byte) are those the
    runtime's VersionBook takes in the steady state, stage by stage: async and 2bw one on every stage whose forwards
    run ahead of their backwards and none on the last (2bw: its update deferred instead), flush schedules none."""
    import itertools

    kind = schedule_kind(name)
    for S in (1, 2, 3, 4):
        for reps in itertools.product((1, 2), repeat=S):
            m = 4
            if kind.violation(m, reps) is not None:
                continue
            if kind.flush:
                assert all(kind.copies_per_update(reps, s) == 0 for s in range(S))
                continue
            sched = generate(name, S, 12 * m, reps, minibatch=m)
            per_update = _copies_per_update(sched, m)
            model = [kind.copies_per_update(reps, sched.stage_of(w)) for w in range(len(per_update))]
            assert per_update == model, (reps, per_update, model)
