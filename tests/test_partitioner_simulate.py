"""The schedule simulator: textbook bubbles, steady-state async, communication, all-reduce, memory."""
from __future__ import annotations

import pytest

from partitioner.planner import CostModel, LayerCosts
from partitioner.simulate import StageCost, simulate
from partitioner.topology import Topology
from pipeflow.schedule import warmup_forwards


def uniform(stages: int, f: float = 1.0, b: float = 2.0, **kw: float) -> list[StageCost]:
    return [StageCost(f, b, **kw) for _ in range(stages)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_textbook_bubble(schedule: str, S: int, m: int) -> None:
    r = simulate(schedule, uniform(S), None, m)
    assert r.step_ms == pytest.approx((m + S - 1) * 3.0, rel=1e-12)
    assert r.bubble_fraction == pytest.approx((S - 1) / (m + S - 1), abs=1e-12)


@pytest.mark.parametrize("schedule", ["async", "2bw"])
@pytest.mark.parametrize("S", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_flush_free_schedules_have_no_steady_state_bubble(schedule: str, S: int, m: int) -> None:
    r = simulate(schedule, uniform(S), None, m)
    assert r.step_ms == pytest.approx(m * 3.0, rel=1e-12)
    assert r.bubble_fraction == pytest.approx(0.0, abs=1e-12)


def test_sends_delay_the_consumer() -> None:
    # gpipe, 2 stages, 1 microbatch: F0 | send | F1 ; B1 | send | B0
    r = simulate("gpipe", uniform(2, send_ms=0.5), None, 1)
    assert r.step_ms == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


def test_messages_on_a_link_serialize() -> None:
    # Stage 0 forwards in 1 ms each, the link needs 3 ms per message: stage 1 is fed every 3 ms, and
    # its (instant) backwards send 4 gradients back over the 3 ms link too.
    stages = [StageCost(1.0, 0.0, send_ms=3.0), StageCost(0.1, 0.0)]
    r = simulate("gpipe", stages, None, 4)
    assert r.step_ms == pytest.approx(1 + 4 * 3 + 0.1 + 4 * 3, rel=1e-9)


def test_allreduce_at_step_for_replicas_only() -> None:
    one = simulate("1f1b", uniform(1, allreduce_ms=5.0), [1], 2)
    two = simulate("1f1b", uniform(1, allreduce_ms=5.0), [2], 2)
    assert one.step_ms == pytest.approx(6.0)  # one replica: nothing to reduce
    assert two.step_ms == pytest.approx(3.0 + 5.0)  # each replica one microbatch, then the all-reduce
    assert two.bubble_fraction == pytest.approx(5.0 / 8.0)


def test_replicated_stage_halves_its_share() -> None:
    # Stage 0 is twice as slow but has 2 replicas: balanced, so 1f1b reaches the textbook bubble of 2 stages.
    r = simulate("1f1b", [StageCost(2.0, 4.0), StageCost(1.0, 2.0)], [2, 1], 8)
    assert r.step_ms < simulate("1f1b", [StageCost(2.0, 4.0), StageCost(1.0, 2.0)], [1, 1], 8).step_ms / 1.5


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async", "2bw"])
@pytest.mark.parametrize("reps", [(1, 1, 1), (2, 1, 1), (1, 2, 3)])
def test_peak_memory_matches_the_planner_model(schedule: str, reps: tuple[int, ...]) -> None:
    m = 6
    r = simulate(schedule, uniform(3, parameter_bytes=10.0, activation_bytes=100.0), reps, m, optimizer="sgd")
    lay = LayerCosts.of([1.0] * 3, [2.0] * 3, [0.0] * 3, [100.0] * 3, [10.0] * 3)
    model = CostModel(lay, Topology.default(sum(reps)), schedule, m, "sgd")
    for s in range(3):
        down = sum(reps[s:])
        assert r.peak_memory_bytes[s] == model.memory_bytes(s, s + 1, reps[s], down)
        if schedule != "gpipe":
            assert r.peak_in_flight[s] == min(warmup_forwards(reps, s) + 1,
                                              -(-m // reps[s]) if schedule == "1f1b" else 10**9)


def test_timeline_intervals() -> None:
    r = simulate("1f1b", uniform(2), None, 2, keep_timeline=True)
    kinds = sorted((iv.worker, iv.kind, iv.microbatch) for iv in r.timeline if iv.kind != "STEP")
    assert kinds == sorted((w, k, i) for w in (0, 1) for k in "FB" for i in (0, 1))
    assert all(iv.end >= iv.start >= 0 for iv in r.timeline)
    assert max(iv.end for iv in r.timeline) == pytest.approx(r.step_ms)
