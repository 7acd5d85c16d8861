"""The runtime's own costs (profile.json `action_ms`, `message_ms`; issue 13 "Accuracy"): priced once
(costmodel.LayerCosts.stage_overhead_ms) for the DP's bound and the simulator alike, and read from a trace
by partitioner.calibrate."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from partitioner.calibrate import calibrate
from partitioner.calibrate import main as calibrate_main
from partitioner.plan import Plan, StagePlan
from partitioner.planner import CostModel, Node, evaluate
from partitioner.profile import LayerProfile, Profile, ProfileError
from partitioner.service import evaluate_plan, layer_costs, plan_detailed
from partitioner.topology import Topology


def profile(**runtime: float) -> Profile:
    """Two layers of 1 ms forward and 1 ms backward, nothing to send or reduce, no loss or optimizer time."""
    return Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 1.0, 0, 0, 0) for i in range(2)],
                   **runtime)


def straight(schedule: str, m: int) -> Plan:
    return Plan(schedule, m, 2, [StagePlan((0, 1), 1, [0]), StagePlan((1, 2), 1, [1])])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_action_and_message_costs_exactly_its_time(schedule: str) -> None:
    # One microbatch through two stages: F0 F1 B1 B0 in a row, 4 ms. action_ms adds to each of the four;
    # message_ms to the two that send (F0 the activation, B1 the gradient).
    step = {key: evaluate_plan(profile(**kw), straight(schedule, 1)).plan.predicted["step_ms"]
            for key, kw in (("none", {}), ("action", {"action_ms": 0.25}), ("message", {"message_ms": 0.5}),
                            ("both", {"action_ms": 0.25, "message_ms": 0.5}))}
    assert step == pytest.approx({"none": 4.0, "action": 5.0, "message": 5.0, "both": 6.0}, abs=1e-9)


def test_one_worker_pays_two_actions_per_microbatch_and_no_message() -> None:
    for m in (1, 4):
        plain = plan_detailed(profile(), 1, schedule="1f1b", microbatches=m).plan.predicted["step_ms"]
        priced = plan_detailed(profile(action_ms=0.1, message_ms=7.0), 1, schedule="1f1b",
                               microbatches=m).plan.predicted["step_ms"]
        assert plain == pytest.approx(4.0 * m) and priced == pytest.approx(plain + 2 * 0.1 * m)


def test_the_bound_counts_the_same_overhead_as_the_simulator() -> None:
    # Stage costs (simulator) and the DP's bound of the same plan move by the same amounts.
    prof = profile(action_ms=0.25, message_ms=0.5)
    costs = evaluate_plan(prof, straight("gpipe", 3)).costs
    assert [(c.forward_ms, c.backward_ms) for c in costs] == [(1.75, 1.25), (1.25, 1.75)]
    lay = layer_costs(prof, "gpipe", "adam")
    model = CostModel(lay, Topology.parse("2x10GB/s"), "gpipe", 3, "adam")
    plain = CostModel(layer_costs(profile(), "gpipe", "adam"), Topology.parse("2x10GB/s"), "gpipe", 3, "adam")
    tree = Node(0, [(0, 1, 1, None), (1, 2, 1, None)])
    # Stage 1's bound: the forward of layer 0 before it, its own work, the backward of layer 0 after it.
    assert evaluate(plain, tree) == pytest.approx(1.0 + 3 * 2.0 + 1.0)
    assert evaluate(model, tree) == pytest.approx(1.0 + 3 * 3.0 + 1.0)
    # The simulated gpipe step: stage 0 forwards at 0, 1.75, 3.5; stage 1's three forwards end at 6.5, its
    # backwards at 11.75, stage 0's last backward follows: 13.
    assert evaluate_plan(prof, straight("gpipe", 3)).plan.predicted["step_ms"] == pytest.approx(13.0)


def test_round_trip_and_validation(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    profile(action_ms=0.25, message_ms=0.5).save(path)
    d = json.loads(path.read_text())
    assert (d["action_ms"], d["message_ms"]) == (0.25, 0.5)
    again = Profile.load(path)
    assert (again.action_ms, again.message_ms) == (0.25, 0.5)
    profile().save(path)
    assert "action_ms" not in json.loads(path.read_text())  # absent: written as before
    d["message_ms"] = -1
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"^p\.json: message_ms must be a number in \[0, 1e\+09\] \(ms\), "
                                           r"found -1$"):
        Profile.load(path)


def trace(spans: dict[int, list[tuple[str, float, float]]], steps: int, period: float = 100.0) -> dict[str, Any]:
    """A Chrome trace as pipeflow-train writes it: the same spans (name, start ms, duration ms) per step,
    steps `period` ms apart."""
    events = [{"name": name, "ph": "X", "pid": 0, "tid": rank, "ts": (period * s + t) * 1e3, "dur": d * 1e3,
               "args": {"step": s}} for rank, xs in spans.items() for s in range(steps) for name, t, d in xs]
    return {"traceEvents": [{"name": "process_name", "ph": "M", "pid": 0}, *events]}


def test_calibrate_reads_dispatch_and_sends_from_the_trace(tmp_path: Path) -> None:
    # Each stage's forward + backward is profiled at 2 ms per microbatch. Rank 0 runs F0 (1.5 ms), sends
    # (0.3 ms), waits 2.2 ms, then B0 (1.5 ms) after a 0.2 ms gap: own time 3.2 ms = 2 + 2 x 0.6.
    spans = {0: [("F0", 0.0, 1.5), ("SEND_F0", 1.5, 0.3), ("WAIT_B0", 1.8, 2.2), ("B0", 4.0, 1.5), ("STEP", 5.7, 1.0)],
             1: [("WAIT_F0", 0.0, 1.8), ("F0", 1.8, 1.4), ("B0", 3.2, 1.4), ("SEND_B0", 4.6, 0.3), ("STEP", 4.9, 1.0)]}
    prof, plan = profile(), straight("gpipe", 1)
    found = calibrate(prof, plan, trace(spans, 5), skip=2)
    assert {k: found[k] for k in ("action_ms", "message_ms")} == pytest.approx({"action_ms": 0.5, "message_ms": 0.3})
    prof.others = [Profile("m", {}, "cpu", "float32", 2, [LayerProfile(f"l{i}", 2.0, 2.0, 0, 0, 0) for i in range(2)])]
    # Rank 1: own 2.8 with no gap -> 0.4; the median over both ranks' steps 2-4 is 0.5.
    (tmp_path / "t.json").write_text(json.dumps(trace(spans, 5)))
    prof.save(tmp_path / "p.json")
    plan.save(tmp_path / "plan.json")
    assert calibrate_main([str(tmp_path / x) for x in ("p.json", "plan.json", "t.json")]
                          + ["-o", str(tmp_path / "out.json")]) == 0
    out = Profile.load(tmp_path / "out.json")
    assert (out.action_ms, out.message_ms) == pytest.approx((0.5, 0.3))
    # Written at every microbatch size the file holds (pipeflow-plan --global-batch plans each).
    assert (out.others[0].action_ms, out.others[0].message_ms) == pytest.approx((0.5, 0.3))


def test_calibrated_latency_makes_the_simulation_take_the_traced_step_time() -> None:
    # The same spans, steps 100 ms apart: what the simulation with the calibrated action and message costs
    # leaves of the 100 ms is read as a latency per message, at which the simulated step takes 100 ms.
    spans = {0: [("F0", 0.0, 1.5), ("SEND_F0", 1.5, 0.3), ("WAIT_B0", 1.8, 2.2), ("B0", 4.0, 1.5), ("STEP", 5.7, 1.0)],
             1: [("WAIT_F0", 0.0, 1.8), ("F0", 1.8, 1.4), ("B0", 3.2, 1.4), ("SEND_B0", 4.6, 0.3), ("STEP", 4.9, 1.0)]}
    prof, plan = profile(), straight("1f1b", 1)
    found = calibrate(prof, plan, trace(spans, 5), skip=2)
    without = evaluate_plan(profile(action_ms=found["action_ms"], message_ms=found["message_ms"]), plan)
    assert without.plan.predicted["step_ms"] < 10  # the traced 100 ms are mostly unexplained
    with_latency = evaluate_plan(profile(**found), plan)
    assert with_latency.plan.predicted["step_ms"] == pytest.approx(100.0, abs=1e-6)
    # One microbatch through two stages: its activation and its gradient lie on the critical path.
    assert found["latency_ms"] == pytest.approx((100.0 - without.plan.predicted["step_ms"]) / 2, abs=1e-6)
    # A run no slower than its simulation has no latency to explain.
    assert calibrate(prof, plan, trace(spans, 5, period=without.plan.predicted["step_ms"]), skip=2)["latency_ms"] == 0.0


def test_latency_delays_the_receiver_but_does_not_hold_the_link() -> None:
    # Two stages, 4 microbatches, messages of 1 ms on the link: a latency of 5 ms delays each stage-1 forward
    # by 5 ms, but the sender's next message still leaves 1 ms after the last (the link is free).
    from partitioner.simulate import StageCost, simulate

    base = [StageCost(1.0, 2.0, send_ms=1.0), StageCost(1.0, 2.0)]
    late = [StageCost(1.0, 2.0, send_ms=1.0, latency_ms=5.0), StageCost(1.0, 2.0)]
    t0 = simulate("gpipe", base, microbatches=4, keep_timeline=True)
    t1 = simulate("gpipe", late, microbatches=4, keep_timeline=True)
    f1 = sorted(iv.start for iv in t0.timeline if iv.worker == 1 and iv.kind == "F")
    g1 = sorted(iv.start for iv in t1.timeline if iv.worker == 1 and iv.kind == "F")
    assert [b - a for a, b in zip(f1, g1)] == pytest.approx([5.0] * 4)
    assert t1.step_ms == pytest.approx(t0.step_ms + 2 * 5.0)  # the first forward's and the last gradient's


def test_calibrate_refuses_a_trace_without_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": []}))
    profile().save(tmp_path / "p.json")
    straight("gpipe", 1).save(tmp_path / "plan.json")
    rc = calibrate_main([str(tmp_path / x) for x in ("p.json", "plan.json", "t.json")] + ["-o", str(tmp_path / "o")])
    assert rc == 2
    assert capsys.readouterr().err == ("calibrate: error: the trace holds no forward after step 2: run pipeflow-train "
                                       "--trace for more steps on this plan\n")


def test_calibrate_reads_the_allreduce_bandwidth_of_replicas() -> None:
    # One stage of 2 MB on two replicas: the last backward (2 ms) and STEP (2 ms, no optimizer time
    # profiled) hold the all-reduce of 2 (r-1)/r * 2e6 = 2e6 bytes: 2e6 / 4 ms = 0.5 GB/s.
    prof = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 1.0, 0, 0, 1_000_000) for i in range(2)])
    plan = Plan("1f1b", 2, 2, [StagePlan((0, 2), 2, [0, 1])])
    spans = {r: [("F0", 0.0, 2.0), ("B0", 2.0, 2.0), ("STEP", 4.0, 2.0)] for r in (0, 1)}
    assert calibrate(prof, plan, trace(spans, 4)) == pytest.approx({"action_ms": 0.0, "link_bandwidth": 5e8})


def test_calibrate_refuses_an_interleaved_plan() -> None:
    plan = Plan("interleaved", 2, 2, [StagePlan((k, k + 1), 1, [k % 2]) for k in range(4)])
    prof = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 1.0, 0, 0, 0) for i in range(4)])
    with pytest.raises(ProfileError, match=r"^calibrate needs a plan with one stage per rank, found 2 chunks per rank"):
        calibrate(prof, plan, trace({0: [("F0", 0.0, 1.0)]}, 3))
