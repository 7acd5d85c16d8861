"""Schedules as data: round-trip, generators, validation errors and the dry run (pure, no processes)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeflow.schedule import (
    SCHEDULES,
    Action,
    ScheduleError,
    dry_run,
    from_lists,
    generate,
    warmup_forwards,
)


@pytest.mark.parametrize("text", ["F3", "B0", "W12", "SEND_F3", "RECV_B7", "STEP", "1F3", "2SEND_B3"])
def test_action_string_round_trips(text):
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("bad", ["", "X3", "F", "SEND_F", "STEP3x", "f3"])
def test_action_parse_rejects(bad):
    with pytest.raises(ValueError, match="cannot parse action|needs a microbatch"):
        Action.parse(bad)


def compute(sched, w):
    return [str(a) for a in sched.actions[w] if a.is_compute or a.kind == "STEP"]


def test_1f1b_matches_the_textbook_order():
    s = generate("1f1b", 3, 4)
    assert compute(s, 0) == "F0 F1 F2 B0 F3 B1 B2 B3 STEP".split()
    assert compute(s, 1) == "F0 F1 B0 F2 B1 F3 B2 B3 STEP".split()
    assert compute(s, 2) == "F0 B0 F1 B1 F2 B2 F3 B3 STEP".split()


def test_gpipe_all_forwards_then_all_backwards():
    s = generate("gpipe", 2, 3)
    assert compute(s, 0) == "F0 F1 F2 B0 B1 B2 STEP".split()


def test_async_steps_after_every_backward():
    s = generate("async", 2, 4, minibatch=2)
    assert compute(s, 1) == "F0 B0 STEP F1 B1 STEP F2 B2 STEP F3 B3 STEP".split()


def test_2bw_steps_at_minibatch_ends():
    s = generate("2bw", 2, 4, minibatch=2)
    assert compute(s, 1) == "F0 B0 F1 B1 STEP F2 B2 F3 B3 STEP".split()


def test_receives_are_posted_before_the_previous_compute():
    s = generate("1f1b", 2, 2)
    assert [str(a) for a in s.actions[1]] == "RECV_F0 F0 RECV_F1 B0 SEND_B0 F1 B1 SEND_B1 STEP".split()


def test_replicas_split_microbatches_round_robin():
    s = generate("1f1b", 2, 5, [1, 2])
    assert s.microbatches_of(1) == [0, 2, 4] and s.microbatches_of(2) == [1, 3]
    assert s.peer(0, Action("SEND_F", 3)) == 2


def test_warmup_is_noam_minus_one():
    assert [warmup_forwards([1, 1, 1, 1], s) for s in range(4)] == [3, 2, 1, 0]
    assert warmup_forwards([1, 2], 0) == 2 and warmup_forwards([2, 1], 0) == 1


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'.*gpipe, 1f1b, async, 2bw, interleaved"):
        generate("zigzag", 2, 2)


def test_missing_backward_is_reported_with_the_grid():
    with pytest.raises(ScheduleError, match=r"worker 0 \(stage 0\) never runs B1") as e:
        from_lists("x", 1, 2, [["F0", "F1", "B0", "STEP"]])
    assert "<-- ERROR HERE" in str(e.value) and "step" in str(e.value)


def test_mismatched_channel_order_is_rejected():
    lists = [["F0", "SEND_F0", "F1", "SEND_F1", "RECV_B0", "RECV_B1", "B0", "B1", "STEP"],
             ["RECV_F1", "RECV_F0", "F0", "F1", "B0", "SEND_B0", "B1", "SEND_B1", "STEP"]]
    with pytest.raises(ScheduleError, match=r"channel 0->1 \(F\): sends \[0, 1\] but receives \[1, 0\]"):
        from_lists("x", 2, 2, lists)


def test_deadlock_is_found_and_marked():
    # Stage 0 waits for B0's gradient before sending F0: nobody can move.
    lists = [["RECV_B0", "F0", "B0", "SEND_F0", "STEP"],
             ["RECV_F0", "F0", "B0", "SEND_B0", "STEP"]]
    with pytest.raises(ScheduleError, match="SEND_F0 before F0|deadlock"):
        from_lists("x", 2, 1, lists)
    lists = [["F0", "RECV_B0", "B0", "SEND_F0", "STEP"],
             ["RECV_F0", "F0", "B0", "SEND_B0", "STEP"]]
    with pytest.raises(ScheduleError, match=r"deadlock: worker 0 at B0, worker 1 at F0") as e:
        from_lists("x", 2, 1, lists)
    assert str(e.value).count("*") == 4  # both stuck cells are marked


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(SCHEDULES), stages=st.integers(1, 8), m=st.integers(1, 32),
       reps=st.lists(st.integers(1, 3), min_size=8, max_size=8))
def test_every_generated_schedule_is_valid_and_deadlock_free(name, stages, m, reps):
    # async/2bw with replicas need counts the replicas share evenly: see test_async.py.
    replicas = reps[:stages] if name in ("gpipe", "1f1b") else [1] * stages
    minibatch = max(1, stages - 1, m // 2) if name == "2bw" else m  # 2bw: m >= stages - 1 (test_kinds.py)
    total = minibatch * 2 if name == "2bw" else m
    s = generate(name, stages, total, replicas, minibatch=minibatch)  # validates and dry-runs
    order = dry_run(s)
    assert len(order) == sum(len(a) for a in s.actions)
    for w in range(len(s.workers)):
        mine = s.microbatches_of(w)
        fwd = [a.microbatch for a in s.actions[w] if a.kind == "F"]
        bwd = [a.microbatch for a in s.actions[w] if a.kind == "B"]
        assert fwd == mine and bwd == mine  # each exactly once, in order


def test_fill_warmup_covers_the_round_trip():
    from pipeflow.schedule import fill_warmup

    assert [fill_warmup([1, 1, 1, 1], s) for s in range(4)] == [9, 6, 3, 0]
    s = generate("1f1b", 4, 12, warmup=[9, 6, 3, 0])
    assert compute(s, 0)[:11] == [f"F{i}" for i in range(10)] + ["B0"]


def test_warmup_is_for_1f1b_and_2bw_only():
    with pytest.raises(ScheduleError, match="warm-up depth applies to 1f1b and 2bw only, not 'async'"):
        generate("async", 2, 4, warmup=[1, 0], minibatch=2)
    with pytest.raises(ScheduleError, match=r"warmup must be 2 non-negative counts \(one per stage\), found \[1\]"):
        generate("1f1b", 2, 4, warmup=[1])


@settings(max_examples=80, deadline=None)
@given(stages=st.integers(1, 6), m=st.integers(1, 24), data=st.data())
def test_any_warmup_depth_is_valid_and_deadlock_free(stages, m, data):
    # Depths that do not increase downstream: a stage must send at least as many forwards before its
    # first backward as the next stage needs before its own.
    warmup = sorted(data.draw(st.lists(st.integers(0, 30), min_size=stages, max_size=stages)), reverse=True)
    s = generate("1f1b", stages, m, warmup=warmup)
    for w in range(stages):
        fwd_before_b = next(i for i, a in enumerate(x for x in s.actions[w] if x.is_compute) if a.kind == "B")
        assert fwd_before_b == min(warmup[w] + 1, m)


def test_warmup_deeper_downstream_deadlocks_and_says_so():
    with pytest.raises(ScheduleError, match=r"deadlock: worker 0 at B0, worker 1 at F1 can never proceed"):
        generate("1f1b", 2, 2, warmup=[0, 1])
