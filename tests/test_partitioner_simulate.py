"""The schedule simulator: textbook bubbles, steady-state async, communication, all-reduce, memory."""
from __future__ import annotations

import pytest

from partitioner.planner import CostModel, LayerCosts
from partitioner.simulate import StageCost, simulate
from partitioner.topology import Topology
from pipeflow.schedule import ScheduleError, warmup_forwards


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
    if schedule == "2bw" and m < S - 1:  # two weight versions need m >= S - 1 (test_kinds.py)
        with pytest.raises(ScheduleError, match="more than its share of a minibatch"):
            simulate(schedule, uniform(S), None, m)
        return
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
    # Each replica one microbatch; the all-reduce is bucketed into the last backward (pipeflow/reduce.py):
    # it starts with that backward (at 1 ms) and hides 2 of its 5 ms.
    assert two.step_ms == pytest.approx(1.0 + 5.0)
    assert two.bubble_fraction == pytest.approx(1 - 6.0 / 12.0)


def test_allreduce_waits_for_the_last_replica_and_optimizer_step_follows() -> None:
    # Replica 0 runs microbatches 0, 2, replica 1 runs 1: the all-reduce starts when replica 0 starts its
    # last backward (F0 B0 F2 B2: at 4 ms), ends at max(6, 4 + 1) = 6, then 0.5 ms of optimizer step.
    r = simulate("1f1b", uniform(1, allreduce_ms=1.0, optimizer_ms=0.5), [2], 3)
    assert r.step_ms == pytest.approx(6.5)


def test_fan_in_shares_the_receivers_port() -> None:
    # Three replicas of stage 0 feed one worker: its receive port takes the three 4 ms activations one
    # after another (1 + 12 ms), and its send port returns the three gradients one after another (12 ms).
    # A link per pair would take 1 + 4 + 4 ms.
    stages = [StageCost(1.0, 0.0, send_ms=4.0), StageCost(0.0, 0.0)]
    r = simulate("gpipe", stages, [3, 1], 3)
    assert r.step_ms == pytest.approx(1 + 3 * 4.0 + 3 * 4.0)


def test_full_duplex_ports() -> None:
    # Two stages, gpipe, 2 microbatches, 0.5 ms compute, 2 ms messages. Forward activations go 0 -> 1
    # on 0's send port, gradients 1 -> 0 on 1's send port: they do not queue behind each other.
    stages = [StageCost(0.5, 0.5, send_ms=2.0), StageCost(0.5, 0.5)]
    r = simulate("1f1b", stages, None, 2)
    # F0 0-0.5, msg 0.5-2.5, F1(s0) 0.5-1.0, msg 2.5-4.5; s1: F0 2.5-3, B0 3-3.5, grad 3.5-5.5;
    # F1 4.5-5, B1 5-5.5, grad 5.5-7.5; s0: B0 5.5-6, B1 7.5-8.
    assert r.step_ms == pytest.approx(8.0)


def test_pair_bandwidth_from_the_topology() -> None:
    # 1e6 bytes per message: 0.1 ms inside a 10 GB/s group, 1 ms across the 1 GB/s level.
    topo = Topology.parse("2x10GB/s,2x1GB/s")
    stages = [StageCost(0.0, 0.0, output_bytes=1e6), StageCost(0.0, 0.0)]
    near = simulate("gpipe", stages, None, 1, ranks=[[0], [1]], topology=topo)
    far = simulate("gpipe", stages, None, 1, ranks=[[0], [2]], topology=topo)
    assert near.step_ms == pytest.approx(0.2) and far.step_ms == pytest.approx(2.0)


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
