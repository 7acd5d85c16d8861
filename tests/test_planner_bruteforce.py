"""One cost model: the plan `pipeflow-plan` writes has the least simulated step time of ALL plans (brute force)."""
from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from partitioner.cli import main
from partitioner.planner import CostModel, Node, evaluate
from partitioner.price import Priced, price, schedule_rule, tune_warmup
from partitioner.profile import LayerProfile, Profile
from partitioner.service import layer_costs
from partitioner.topology import Topology


def compositions(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[t + 1] - bounds[t] for t in range(parts))


def all_plans(layers: int, workers: int) -> Iterator[tuple[list[tuple[int, int]], list[list[int]]]]:
    """Every plan on one level: contiguous stages, each on some consecutive ranks."""
    for parts in range(1, min(layers, workers) + 1):
        for lens in compositions(layers, parts):
            starts = list(itertools.accumulate((0, *lens)))
            for us in compositions(workers, parts):
                rstarts = list(itertools.accumulate((0, *us)))
                yield ([(starts[t], starts[t + 1]) for t in range(parts)],
                       [list(range(rstarts[t], rstarts[t + 1])) for t in range(parts)])


def brute_force(profile: Profile, topology: Topology, schedule: str, m: int, optimizer: str = "adam",
                shard: bool = False) -> float:
    """The least simulated step time over all plans (at the schedule's own warm-up); checks on the way that
    the DP's bound of each plan is at most its simulated time under a flush, deeper warm-ups included (what
    makes the search exact). The steady state of async and 2bw is measured from two finite runs, which the
    bound can exceed by a few percent."""
    lay = replace(layer_costs(profile, schedule, optimizer), shard_optimizer=shard)  # --shard-optimizer
    model = CostModel(lay, topology, schedule, m, optimizer)
    best = float("inf")
    for ranges, ranks in all_plans(len(profile.layers), topology.workers):
        if schedule_rule(schedule, m, [len(r) for r in ranks]):
            continue
        priced = Priced(*price(lay, topology, schedule, m, ranges, ranks, optimizer=optimizer))
        t = priced.sim.step_ms
        deeper = tune_warmup(lay, topology, schedule, m, ranges, ranks, optimizer=optimizer, memory_per_worker=None,
                             priced=priced).sim.step_ms
        bound = evaluate(model, Node(0, [(a, b, len(r), None) for (a, b), r in zip(ranges, ranks)]))
        if schedule in ("gpipe", "1f1b"):
            assert bound <= deeper * (1 + 1e-12), (ranges, [len(r) for r in ranks], bound, deeper)
        best = min(best, t)
    return best


def cli_plan(tmp_path: Path, profile: Profile, *args: str) -> dict | None:
    """plan.json as written by the CLI; None when it exits 2 (no plan)."""
    src, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile.save(src)
    rc = main([str(src), *args, "-o", str(out)])
    assert rc in (0, 2)
    return json.loads(out.read_text()) if rc == 0 else None


def random_profile(rng: random.Random, n: int) -> Profile:
    opt = rng.choice([{}, {"adam": rng.choice([1e-7, 1e-6])}])
    prof = Profile("m", {}, "cpu", "float32", 1,
                   [LayerProfile(f"l{i}", rng.uniform(0.1, 3), rng.uniform(0.1, 6), rng.choice([0, 1e4, 1e6, 4e6]),
                                 1000, rng.choice([0, 1e5, 1e6, 1e7]),
                                 rng.choice([None, rng.uniform(0.1, 6)])) for i in range(n)],
                   loss_ms=rng.choice([None, rng.uniform(0, 2)]), optimizer_ms_per_byte=opt)
    # The runtime's own costs (calibrated on CPU), in a third of the cases: they change which plan wins.
    if rng.random() < 1 / 3:
        prof.action_ms, prof.message_ms, prof.latency_ms = rng.uniform(0, 1), rng.uniform(0, 2), rng.uniform(0, 3)
        prof.step_gap_ms, prof.compute_factor = rng.uniform(0, 2), rng.uniform(0.8, 1.5)
        prof.layer_ms, prof.update_ms = rng.uniform(0, 0.5), rng.uniform(0, 2)
    # Weight copies and the ranks' contention (pipeflow-profile): priced by the simulator above the DP's bound.
    if rng.random() < 1 / 3:
        prof.copy_ms_per_byte, prof.contention = rng.choice([0.0, 1e-7, 1e-6]), rng.uniform(0.9, 1.6)
    return prof


@pytest.mark.parametrize("seed", range(60))
def test_cli_choice_is_the_fastest_simulated_plan(tmp_path: Path, seed: int,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(seed)
    n, workers = rng.randint(1, 6), rng.randint(1, 5)
    schedule = ("gpipe", "1f1b", "async", "2bw")[seed % 4]
    m = rng.randint(1, 6)
    bw = rng.choice(["1GB/s", "10GB/s", "100GB/s"])
    profile = random_profile(rng, n)
    topo = Topology.parse(f"{workers}x{bw}")
    shard = random.Random(-seed).random() < 0.4  # its own draw: the others stay those of the seed
    want = brute_force(profile, topo, schedule, m, shard=shard)
    plan = cli_plan(tmp_path, profile, "--workers", str(workers), "--topology", str(topo), "--schedule", schedule,
                    "--microbatches", str(m), *(["--shard-optimizer"] if shard else []))
    if want == float("inf"):  # the schedule's rules leave no plan: one line saying so
        assert plan is None
        err = capsys.readouterr().err
        assert err.startswith(f"pipeflow-plan: error: no plan of {n} layers on {workers} workers fits --schedule "
                              f"{schedule} with {m} microbatches") and err.count("\n") == 1, err
        return
    assert plan is not None
    assert "warmup" not in plan  # a CPU profile: the schedule's own warm-up (the next test: GPU profiles)
    assert plan["predicted"]["step_ms"] == pytest.approx(want, rel=1e-9, abs=2e-6)  # written to 6 decimals
    assert plan.get("shard_optimizer", False) is (shard and any(st["replicas"] > 1 for st in plan["stages"]))
    if not (profile.contention or 1.0) > 1.0:  # contention scales the simulated layers above the DP's bound: the
        # search may stop at its simulation limit (the plan above is still the fastest) and then claims no proof
        assert plan["planner"]["search"]["exact"] is (schedule in ("gpipe", "1f1b"))


def test_flush_bubble_makes_data_parallelism_win(tmp_path: Path) -> None:
    # Issue 13: 8 equal layers on 4 workers, m = 4. Four straight stages: (m + S - 1) x 6 ms = 42 ms;
    # data parallelism: 8 microbatch-layers of 3 ms on each worker = 24 ms (the all-reduce hides in the
    # last backward). The steady-state bound alone ties them at 24 ms per minibatch.
    profile = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 2.0, 1000, 1000, 1000)
                                                     for i in range(8)])
    for schedule in ("gpipe", "1f1b"):
        plan = cli_plan(tmp_path, profile, "--workers", "4", "--schedule", schedule, "--microbatches", "4")
        assert plan is not None
        assert [s["replicas"] for s in plan["stages"]] == [4]
        assert plan["predicted"]["step_ms"] == pytest.approx(24.0, rel=1e-3)
        straight = price(layer_costs(profile, schedule, "adam"), Topology.default(4), schedule, 4,
                         [(0, 2), (2, 4), (4, 6), (6, 8)], [[0], [1], [2], [3]], optimizer="adam")[1]
        assert straight.step_ms == pytest.approx(42.0, rel=1e-3)


def test_straight_pipelines_get_the_fastest_split_and_then_their_best_warm_up(tmp_path: Path) -> None:
    """1f1b, --straight (every stage one worker, where the warm-up matters most), 2-4 workers, CUDA profiles (the
    planner deepens the warm-up on GPUs only): the split is the fastest at DAPPLE's minimum of all straight plans,
    and the plan's warm-up and time are tune_warmup's for it. Some of the 24 draws deepen the warm-up (a test of
    the tuning, not only of its absence)."""
    deepened = 0
    for seed in range(24):
        rng = random.Random(1000 + seed)
        workers = rng.randint(2, 4)
        n, m = rng.randint(workers, 6), rng.randint(2, 8)
        profile = random_profile(rng, n)
        profile.device = "cuda"
        topo = Topology.parse(f"{workers}x{rng.choice(['1GB/s', '10GB/s'])}")
        lay = layer_costs(profile, "1f1b", "adam")
        splits = [[(a, b) for a, b in zip((0, *cuts), (*cuts, n))]
                  for cuts in itertools.combinations(range(1, n), workers - 1)]
        ranks = [[r] for r in range(workers)]
        want = min(price(lay, topo, "1f1b", m, ranges, ranks, optimizer="adam")[1].step_ms for ranges in splits)
        plan = cli_plan(tmp_path, profile, "--workers", str(workers), "--topology", str(topo), "--schedule", "1f1b",
                        "--microbatches", str(m), "--straight")
        assert plan is not None
        ranges = [tuple(st["layers"]) for st in plan["stages"]]
        least = Priced(*price(lay, topo, "1f1b", m, ranges, ranks, optimizer="adam"))
        assert least.sim.step_ms == pytest.approx(want, rel=1e-9)
        tuned = tune_warmup(lay, topo, "1f1b", m, ranges, ranks, optimizer="adam", memory_per_worker=None,
                            priced=least)
        assert plan.get("warmup") == tuned.warmup
        assert plan["predicted"]["step_ms"] == pytest.approx(tuned.sim.step_ms, rel=1e-9, abs=2e-6)
        deepened += tuned.warmup is not None
    assert deepened >= 3, deepened
