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
    # Steps 100 ms apart. Rank 0 waits 94.2 ms for its gradient and leaves 1.3 ms between its steps; rank 1
    # waits for its input from the end of its previous step (its WAIT_F starts 48.1 ms before its step's
    # 100 ms mark), so it leaves none: step_gap_ms is their mean, 0.65. What the simulation with the calibrated
    # action, message and gap costs leaves of the 100 ms is read as a latency per message.
    spans = {0: [("F0", 0.0, 1.5), ("SEND_F0", 1.5, 0.3), ("WAIT_B0", 1.8, 94.2), ("B0", 96.0, 1.5),
                 ("STEP", 97.7, 1.0)],
             1: [("WAIT_F0", -48.1, 95.9), ("F0", 47.8, 1.4), ("B0", 49.2, 1.4), ("SEND_B0", 50.6, 0.3),
                 ("STEP", 50.9, 1.0)]}
    prof, plan = profile(), straight("1f1b", 1)
    found = calibrate(prof, plan, trace(spans, 5), skip=2)
    assert found["step_gap_ms"] == pytest.approx(0.65)
    assert found["update_ms"] == pytest.approx(1.0)  # each STEP beyond its (here zero) profiled optimizer step
    without = evaluate_plan(profile(**{k: found[k] for k in ("action_ms", "message_ms", "step_gap_ms", "update_ms")}),
                            plan)
    assert without.plan.predicted["step_ms"] < 10  # the traced 100 ms are mostly unexplained
    with_latency = evaluate_plan(profile(**found), plan)
    assert with_latency.plan.predicted["step_ms"] == pytest.approx(100.0, abs=1e-6)
    # One microbatch through two stages: its activation and its gradient lie on the critical path.
    assert found["latency_ms"] == pytest.approx((100.0 - without.plan.predicted["step_ms"]) / 2, abs=1e-6)
    # A run no slower than its simulation has no latency to explain: the same work packed into 7 ms steps
    # (gaps 0.3 and 1.1 ms), simulated at 4 x (1 + 0.5) + 2 x 0.3 + 0.7 + 1.0 (rank 0's STEP) = 8.3 ms.
    packed = {0: [("F0", 0.0, 1.5), ("SEND_F0", 1.5, 0.3), ("WAIT_B0", 1.8, 2.2), ("B0", 4.0, 1.5),
                  ("STEP", 5.7, 1.0)],
              1: [("WAIT_F0", 0.0, 1.8), ("F0", 1.8, 1.4), ("B0", 3.2, 1.4), ("SEND_B0", 4.6, 0.3), ("STEP", 4.9, 1.0)]}
    fast = calibrate(prof, plan, trace(packed, 5, period=7.0), skip=2)
    assert fast["step_gap_ms"] == pytest.approx(0.7)
    assert evaluate_plan(profile(**{k: v for k, v in fast.items() if k != "latency_ms"}), plan).plan.predicted[
        "step_ms"] == pytest.approx(8.3)
    assert fast["latency_ms"] == 0.0


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
    assert calibrate(prof, plan, trace(spans, 4)) == pytest.approx({"action_ms": 0.0, "link_bandwidth": 5e8,
                                                                    "step_gap_ms": 94.0})


def test_calibrate_refuses_an_interleaved_plan() -> None:
    plan = Plan("interleaved", 2, 2, [StagePlan((k, k + 1), 1, [k % 2]) for k in range(4)])
    prof = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 1.0, 0, 0, 0) for i in range(4)])
    with pytest.raises(ProfileError, match=r"^calibrate needs a plan with one stage per rank, found 2 chunks per rank"):
        calibrate(prof, plan, trace({0: [("F0", 0.0, 1.0)]}, 3))


def sized(ms: float, n: int = 2) -> Profile:
    """n layers of `ms` forward and `ms` backward: a profile at another microbatch size."""
    return Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", ms, ms, 0, 0, 0) for i in range(n)])


def own_spans(per_mb: float) -> dict[int, list[tuple[str, float, float]]]:
    """Both ranks of a straight pipeline with one microbatch: F and B of per_mb / 2 ms each."""
    h = per_mb / 2
    return {0: [("F0", 0.0, h), ("WAIT_B0", h, 1.0), ("B0", h + 1.0, h)],
            1: [("WAIT_F0", 0.0, 0.5), ("F0", 0.5, h), ("B0", 0.5 + h, h)]}


def test_two_sizes_tell_a_compute_factor_from_a_cost_per_action(tmp_path: Path) -> None:
    # The layers run 1.1 x their profiled time in a stage, and each action costs 0.3 ms more: a rank's own time
    # per microbatch is 1.1 x profiled + 0.6. At one size (2 ms profiled per rank) that is 2.8 ms, read as
    # 0.4 ms per action; with a second size (8 ms profiled: 9.4 ms) the two are told apart.
    small, big, plan = sized(1.0), sized(4.0), straight("gpipe", 1)
    one = calibrate(small, plan, trace(own_spans(2.8), 5), skip=2)
    assert "compute_factor" not in one and one["action_ms"] == pytest.approx(0.4)
    both = calibrate(small, plan, trace(own_spans(2.8), 5), skip=2, also=[(big, plan, trace(own_spans(9.4), 5))])
    assert (both["compute_factor"], both["action_ms"]) == pytest.approx((1.1, 0.3))
    # A fit whose constant would be negative keeps the factor alone, through the origin: (2 x 1.5 x 2 + 2 x 8
    # x 7.9) / (2 x 4 + 2 x 64).
    neg = calibrate(small, plan, trace(own_spans(1.5), 5), skip=2, also=[(big, plan, trace(own_spans(7.9), 5))])
    assert (neg["compute_factor"], neg["action_ms"]) == pytest.approx(((6 + 126.4) / 136, 0.0))
    # The command line: --also PROFILE PLAN TRACE; the factor is written into the first profile.
    for name, prof, per_mb in (("s", small, 2.8), ("b", big, 9.4)):
        prof.save(tmp_path / f"{name}.json")
        (tmp_path / f"{name}-t.json").write_text(json.dumps(trace(own_spans(per_mb), 5)))
    plan.save(tmp_path / "plan.json")
    assert calibrate_main([str(tmp_path / x) for x in ("s.json", "plan.json", "s-t.json")]
                          + ["--also", *(str(tmp_path / x) for x in ("b.json", "plan.json", "b-t.json")),
                             "-o", str(tmp_path / "out.json")]) == 0
    out = Profile.load(tmp_path / "out.json")
    assert (out.compute_factor, out.action_ms) == pytest.approx((1.1, 0.3))
    # Calibrating a calibrated profile reads the layers as profiled, not as already scaled.
    again = calibrate(out, plan, trace(own_spans(2.8), 5), skip=2, also=[(big, plan, trace(own_spans(9.4), 5))])
    assert again["compute_factor"] == pytest.approx(1.1)


def test_compute_factor_and_step_gap_price_the_plan() -> None:
    # gpipe, one microbatch through two stages of 1 + 1 ms: 4 ms; layers twice as slow: 8 ms; and a
    # 0.5 ms gap between steps on top.
    plan = straight("gpipe", 1)
    assert evaluate_plan(profile(), plan).plan.predicted["step_ms"] == pytest.approx(4.0)
    assert evaluate_plan(profile(compute_factor=2.0), plan).plan.predicted["step_ms"] == pytest.approx(8.0)
    assert evaluate_plan(profile(compute_factor=2.0, step_gap_ms=0.5), plan).plan.predicted["step_ms"] == \
        pytest.approx(8.5)


@pytest.mark.parametrize("bad", [0, -1.0, 101.0, "x", True])
def test_profile_refuses_a_bad_compute_factor(bad: Any) -> None:
    d = profile().to_json()
    d["compute_factor"] = bad
    with pytest.raises(ProfileError, match=r"^p.json: compute_factor must be a number in \(0, 100\], found "):
        Profile.from_json(d, source="p.json")


def test_runtime_numbers_survive_a_round_trip(tmp_path: Path) -> None:
    profile(compute_factor=1.25, step_gap_ms=0.75, action_ms=0.5).save(tmp_path / "p.json")
    got = Profile.load(tmp_path / "p.json")
    assert (got.compute_factor, got.step_gap_ms, got.action_ms) == (1.25, 0.75, 0.5)


def test_a_pipeline_and_data_parallelism_tell_a_cost_per_layer_from_a_cost_per_action() -> None:
    # Each action costs 0.1 ms and each layer in it 0.3 ms more than profiled (dispatch per layer call, as on
    # CPU). The pipeline's ranks hold one layer (2 ms profiled per microbatch): own 2 + 2 x 0.1 + 2 x 0.3 = 2.8;
    # the data-parallel ranks hold both (4 ms): 4 + 0.2 + 1.2 = 5.4. Read together: the two costs apart, and
    # no compute factor (one microbatch size: it would pass for one).
    small, plan = sized(1.0), straight("gpipe", 1)
    replicas = Plan("gpipe", 1, 2, [StagePlan((0, 2), 2, [0, 1])])
    dp = trace({r: [("F0", 0.0, 2.7), ("B0", 2.7, 2.7)] for r in (0, 1)}, 5)
    found = calibrate(small, plan, trace(own_spans(2.8), 5), skip=2, also=[(small, replicas, dp)])
    assert "compute_factor" not in found
    assert (found["action_ms"], found["layer_ms"]) == pytest.approx((0.1, 0.3))
    # The planner prices them per stage: gpipe, one microbatch through 2 one-layer stages: 4 x (1 + 0.1 + 0.3).
    assert evaluate_plan(profile(action_ms=0.1, layer_ms=0.3), plan).plan.predicted["step_ms"] == pytest.approx(5.6)
    # Both kinds of runs at two sizes, the layers 1.1 x their profile: all three terms. own = 1.1 x + 0.2 + 0.6 n:
    # 3.0 and 5.8 ms at the small size (x = 2, 4), 9.6 and 19.0 at the big one (x = 8, 16).
    big = sized(4.0)
    dp_big = trace({r: [("F0", 0.0, 9.5), ("B0", 9.5, 9.5)] for r in (0, 1)}, 5)
    three = calibrate(small, plan, trace(own_spans(2.2 + 0.8), 5), skip=2,
                      also=[(small, replicas, trace({r: [("F0", 0.0, 2.9), ("B0", 2.9, 2.9)] for r in (0, 1)}, 5)),
                            (big, plan, trace(own_spans(8.8 + 0.8), 5)), (big, replicas, dp_big)])
    assert (three["compute_factor"], three["action_ms"], three["layer_ms"]) == pytest.approx((1.1, 0.1, 0.3))


def test_calibrate_reads_the_time_per_update_from_an_async_trace_and_the_planner_prices_it() -> None:
    # async updates after every backward. One stage of both layers (2 + 2 ms profiled per microbatch, no
    # optimizer time), 2 microbatches in 12 ms steps: each STEP takes 1.5 ms, and the host 0.5 ms after the
    # first (the gap after the last is the step's: step_gap_ms). Per update (1.5 + 0.5 + 1.5) / 2 = 1.75 ms;
    # the gap after a STEP is not the actions' (action_ms 0).
    prof = profile()
    plan = Plan("async", 2, 1, [StagePlan((0, 2), 1, [0])])
    spans = {0: [("F0", 0.0, 2.0), ("B0", 2.0, 2.0), ("STEP", 4.0, 1.5), ("F1", 6.0, 2.0), ("B1", 8.0, 2.0),
                 ("STEP", 10.0, 1.5)]}
    found = calibrate(prof, plan, trace(spans, 5, period=12.0), skip=2)
    assert found == pytest.approx({"update_ms": 1.75, "action_ms": 0.0, "step_gap_ms": 0.5})
    # Priced per update, it gives the traced step: 2 x (4 + 1.75) + 0.5 = 12 ms. Under 1f1b, one update a
    # step: 2 x 4 + 1.75 + 0.5.
    assert evaluate_plan(profile(**found), plan).plan.predicted["step_ms"] == pytest.approx(12.0)
    flush = Plan("1f1b", 2, 1, [StagePlan((0, 2), 1, [0])])
    assert evaluate_plan(profile(**found), flush).plan.predicted["step_ms"] == pytest.approx(10.25)
    # Read from a flush schedule's trace instead: the STEP spans alone, 1.5 ms each (the host's gap after
    # them is the step's own, step_gap_ms, under a flush schedule).
    assert calibrate(prof, flush, trace(spans, 5, period=12.0), skip=2)["update_ms"] == pytest.approx(1.5)


def test_a_flush_schedules_update_is_read_on_the_rank_that_waited_for_no_other() -> None:
    # gpipe, two stages: rank 1 finishes its backward first and its STEP (3.1 ms) holds the wait for rank 0 in
    # the ranks' agreement; rank 0 reaches its STEP last, and its 1.2 ms are the update's own time (the
    # non-finite check, the agreement, the step beyond its profile: here none). Rank 0's STEP is on the
    # critical path, and the simulator then prices it.
    spans = {0: [("F0", 0.0, 1.5), ("SEND_F0", 1.5, 0.3), ("WAIT_B0", 1.8, 2.2), ("B0", 4.0, 1.5),
                 ("STEP", 5.5, 1.2)],
             1: [("WAIT_F0", 0.0, 1.8), ("F0", 1.8, 1.4), ("B0", 3.2, 1.4), ("SEND_B0", 4.6, 0.3),
                 ("STEP", 4.9, 3.1)]}
    plan = straight("gpipe", 1)
    found = calibrate(profile(), plan, trace(spans, 5, period=8.0), skip=2)
    assert found["update_ms"] == pytest.approx(1.2)
    # async traces, where given, say what an update takes instead (their STEP has no agreement to wait in).
    async_plan = Plan("async", 2, 1, [StagePlan((0, 2), 1, [0])])
    one = {0: [("F0", 0.0, 2.0), ("B0", 2.0, 2.0), ("STEP", 4.0, 0.5), ("F1", 6.0, 2.0), ("B1", 8.0, 2.0),
               ("STEP", 10.0, 0.5)]}
    both = calibrate(profile(), plan, trace(spans, 5, period=8.0), skip=2,
                     also=[(profile(), async_plan, trace(one, 5, period=12.0))])
    assert both["update_ms"] == pytest.approx((0.5 + 1.5 + 0.5) / 2)


def test_a_replicas_last_backward_beside_its_all_reduce_is_not_read_as_its_own_time() -> None:
    # As above, two microbatches on the data-parallel ranks, whose last backward runs 3 ms longer beside the
    # replicas' all-reduce (link_bandwidth prices that time): read as the other backwards, the same two costs.
    small, plan = sized(1.0), straight("gpipe", 1)
    replicas = Plan("gpipe", 2, 2, [StagePlan((0, 2), 2, [0, 1])])
    dp = trace({r: [("F0", 0.0, 2.7), ("F1", 2.7, 2.7), ("B0", 5.4, 2.7), ("B1", 8.1, 5.7), ("STEP", 13.8, 1.0)]
                for r in (0, 1)}, 5)
    found = calibrate(small, plan, trace(own_spans(2.8), 5), skip=2, also=[(small, replicas, dp)])
    assert (found["action_ms"], found["layer_ms"]) == pytest.approx((0.1, 0.3))


@pytest.mark.parametrize(("link_ms", "step_ms", "summed_ms"), [(0.3, 7.0, 7.6), (0.8, 7.6, 8.6)])
def test_a_transfer_starts_with_the_senders_own_time_for_the_message(link_ms: float, step_ms: float,
                                                                    summed_ms: float) -> None:
    # gpipe, one microbatch through two stages, 0.5 ms of each sending action the sender's time for its message
    # (calibrated message_ms, gloo writing it). Stage 0's forward [0, 1.5] starts the transfer at 1.0: stage 1
    # has it at max(1.0 + link, 1.5); its backward ends 3.5 later and its gradient reaches stage 0 the same way,
    # whose backward takes 2. Without the overlap each message would take 0.5 + link after its compute began
    # to send it: 7.6 and 8.6 ms.
    from partitioner.simulate import StageCost, simulate

    stages = [StageCost(1.5, 2.0, send_ms=link_ms, message_ms=0.5), StageCost(1.0, 2.5, message_ms=0.5)]
    assert simulate("gpipe", stages, microbatches=1).step_ms == pytest.approx(step_ms)
    plain = [StageCost(1.5, 2.0, send_ms=link_ms), StageCost(1.0, 2.5)]
    assert simulate("gpipe", plain, microbatches=1).step_ms == pytest.approx(summed_ms)


@pytest.mark.parametrize("schedule, copies", [("async", [1, 0]), ("2bw", [1, 0]), ("1f1b", [0, 0])])
def test_weight_copies_are_priced_per_update(schedule: str, copies: list[int]) -> None:
    """copy_ms_per_byte (one copy of the weights, pipeflow-profile) is added to a stage's update as many times
    as the runtime copies there per update (async: every stage but the last; 2bw: the same, once a minibatch, its
    last stage deferring its update instead, pipeflow/update.py),
    and the step time grows accordingly; before, the copies were not priced."""
    def prof(copy: float | None) -> Profile:
        return Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 1.0, 0, 0, 1000 * (i + 1))
                                                      for i in range(2)],
                       optimizer_ms_per_byte={"adam": 1e-4}, copy_ms_per_byte=copy)
    plan = straight(schedule, 4)
    base, priced = (evaluate_plan(prof(c), plan) for c in (None, 2e-4))
    for k, (a, b) in enumerate(zip(base.costs, priced.costs)):
        assert b.optimizer_ms - a.optimizer_ms == pytest.approx(copies[k] * 2e-4 * 1000 * (k + 1))
    grew = priced.plan.predicted["step_ms"] - base.plan.predicted["step_ms"]
    assert (grew > 0) == any(copies)
    assert Profile.from_json(prof(2e-4).to_json()).copy_ms_per_byte == 2e-4
    with pytest.raises(ProfileError, match=r"^p: copy_ms_per_byte must be a number in \[0, 1e\+09\], found -1$"):
        Profile.from_json({**prof(None).to_json(), "copy_ms_per_byte": -1}, source="p")



@pytest.mark.parametrize("plan, alone, bubble", [
    (Plan("1f1b", 2, 2, [StagePlan((0, 2), 2, [0, 1])]), 4.0, 0.0),  # data parallel: the ranks always compute
    (straight("1f1b", 1), 4.0, 0.5),  # one microbatch through two stages: each computes half the step
])
def test_contention_slows_the_layers_as_far_as_the_ranks_compute_at_once(plan: Plan, alone: float,
                                                                         bubble: float) -> None:
    """profile.contention (a pass beside busy ranks over one alone) scales a plan's layers by
    1 + (contention - 1) u, u the share of the step its ranks compute: fully for data parallelism, half for a
    pipeline that computes half the time; one worker never; and the DP's bound stays the layers alone."""
    base = evaluate_plan(profile(), plan)
    assert base.plan.predicted["step_ms"] == pytest.approx(alone) and base.sim.bubble_fraction == pytest.approx(bubble)
    busy = evaluate_plan(profile(contention=1.5), plan)
    assert busy.plan.predicted["step_ms"] == pytest.approx(alone * (1 + 0.5 * (1 - bubble)))
    one = Plan("1f1b", 2, 1, [StagePlan((0, 2), 1, [0])])
    assert (evaluate_plan(profile(contention=1.5), one).plan.predicted["step_ms"]
            == evaluate_plan(profile(), one).plan.predicted["step_ms"])
    lay = layer_costs(profile(contention=1.5), "1f1b", "adam")
    assert list(lay.forward_ms) == [1.0, 1.0] and lay.contention == 1.5
    with pytest.raises(ProfileError, match=r"^p: contention must be a number in \(0, 100\], found 0$"):
        Profile.from_json({**profile().to_json(), "contention": 0}, source="p")


@pytest.mark.parametrize("schedule, shard, step_ms", [
    ("2bw", False, 8.0),  # its deferred update's all-reduce runs under the next minibatch: hidden
    # sharded: beside the last backward (2 ms), 3 ms after it; the exchange (5 ms) under the next forward (2 ms),
    # whose second layer (1 ms) waits for all of it: 4 ms
    ("2bw", True, 11.0 + 4.0),
    ("async", False, None),  # not deferred: beside each backward
])
def test_a_deferred_update_all_reduces_under_the_next_minibatch(schedule: str, shard: bool,
                                                                step_ms: float | None) -> None:
    """2bw's data parallelism defers its update a STEP (pipeflow/update.py), so its replicas' all-reduce (5 ms) is
    launched at one STEP and waited for at the next, as the runtime does: under a minibatch of 8 ms it costs
    nothing, in the simulator and in the DP's bound alike. Before, both priced it beside the last backward (2 ms),
    11 ms a step."""
    from dataclasses import replace

    from partitioner.price import price
    from partitioner.service import layer_costs

    prof = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 1.0, 0, 0, 2_500_000) for i in range(2)])
    lay = replace(layer_costs(prof, schedule, "adam"), shard_optimizer=shard)
    topology = Topology.parse("2x1GB/s")  # all-reduce of 5 MB over 2: 5 MB / 1 GB/s = 5 ms; the exchange priced so
    got = price(lay, topology, schedule, 4, [(0, 2)], [[0, 1]], optimizer="adam")[1].step_ms
    bound = evaluate(CostModel(lay, topology, schedule, 4, "adam"), Node(0, [(0, 2, 2, None)]))
    if step_ms is None:  # async steps per backward: the all-reduce after each, 3 ms beyond it
        assert got > 8.0 and bound > 8.0
        return
    assert got == pytest.approx(step_ms) and bound == pytest.approx(step_ms)


def test_calibrate_prices_the_update_of_the_optimizer_the_profile_timed(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A profile timed with pipeflow-profile --optimizer sgd: calibrate priced the run's update as adam's, untimed,
    at 0, and read the whole STEP (the update's 0.4 ms too) as the runtime's update_ms."""
    spans = {0: [("F0", 0.0, 1.5), ("SEND_F0", 1.5, 0.3), ("WAIT_B0", 1.8, 2.2), ("B0", 4.0, 1.5), ("STEP", 5.7, 1.0)],
             1: [("WAIT_F0", 0.0, 1.8), ("F0", 1.8, 1.4), ("B0", 3.2, 1.4), ("SEND_B0", 4.6, 0.3), ("STEP", 4.9, 1.0)]}
    prof = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 1.0, 0, 0, 1000) for i in range(2)],
                   optimizer_ms_per_byte={"sgd": 4e-4})  # each stage's update: 0.4 ms
    prof.save(tmp_path / "p.json")
    straight("gpipe", 1).save(tmp_path / "plan.json")
    (tmp_path / "t.json").write_text(json.dumps(trace(spans, 5)))
    args = [str(tmp_path / x) for x in ("p.json", "plan.json", "t.json")] + ["-o", str(tmp_path / "out.json")]
    assert calibrate_main(args) == 0
    assert Profile.load(tmp_path / "out.json").update_ms == pytest.approx(0.6)
    capsys.readouterr()
    assert calibrate_main([*args, "--optimizer", "adam"]) == 2
    assert capsys.readouterr().err == (
        f"calibrate: error: --optimizer adam: {tmp_path / 'p.json'} timed the update of sgd only "
        "(optimizer_ms_per_byte), so adam's updates would be priced at 0; plan with --optimizer sgd, or profile again "
        "with pipeflow-profile --optimizer adam\n")
