"""The DP against exhaustive search under the same cost model, topology parsing, memory limits."""
from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, cast

import numpy as np
import pytest

from partitioner import bands, planner
from partitioner.planner import (
    INF,
    CostModel,
    LayerCosts,
    Node,
    PlanningError,
    Progress,
    Solution,
    evaluate,
    flatten,
    solve,
    tabulate,
)
from partitioner.profile import LayerProfile, Profile
from partitioner.search import search
from partitioner.service import plan_from_profile
from partitioner.topology import Level, Topology, TopologyError, parse_bandwidth, parse_bytes


def compositions(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Ordered tuples of `parts` positive integers summing to n."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[t + 1] - bounds[t] for t in range(parts))


def all_trees(topo: Topology, level: int, i: int, j: int, units: int) -> Iterator[Node]:
    """Every hierarchical plan of layers [i, j) on `units` units of `level`: contiguous stages, each on
    some units, each (above level 0) running a plan of its layers on one whole group of the level below."""
    for parts in range(1, min(j - i, units) + 1):
        for lens in compositions(j - i, parts):
            starts = list(itertools.accumulate((i, *lens)))
            for us in compositions(units, parts):
                ranges = [(starts[t], starts[t + 1], us[t]) for t in range(parts)]
                if level == 0:
                    yield Node(0, [(a, b, u, None) for a, b, u in ranges])
                    continue
                below = topo.levels[level - 1].workers
                children = [list(all_trees(topo, level - 1, a, b, below)) for a, b, _ in ranges]
                for combo in itertools.product(*children):
                    yield Node(level, [(a, b, u, c) for (a, b, u), c in zip(ranges, combo)])


class _Remembered:
    """`model` whose per-stage prices, pure functions of their arguments, are computed once per argument tuple:
    the brute force prices the same stage in thousands of trees (most of this test's time before)."""

    PRICES = ("stage_compute_ms", "stage_ms", "port_ms", "memory_bytes", "outside")

    def __init__(self, model: CostModel) -> None:
        self._model = model
        for name in self.PRICES:
            setattr(self, name, functools.cache(getattr(model, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def exhaustive(model: CostModel) -> float:
    topo = model.topology
    top = len(topo.levels) - 1
    priced = cast(CostModel, _Remembered(model))
    return min((evaluate(priced, t) for t in all_trees(topo, top, 0, model.num_layers, topo.levels[top].workers)),
               default=INF)


def random_model(rng: random.Random) -> CostModel:
    n_layers = rng.randint(1, 10)
    shapes = [(w,) for w in range(1, 7)] + [(a, b) for a in range(1, 4) for b in range(1, 4) if a * b <= 6]
    shape = rng.choice(shapes)
    levels = tuple(Level(n, rng.choice([1e6, 1e7, 1e8, 1e9])) for n in shape)
    lay = LayerCosts.of([rng.uniform(0, 5) for _ in range(n_layers)], [rng.uniform(0, 10) for _ in range(n_layers)],
                        [rng.choice([0, 1e3, 1e5, 1e6]) for _ in range(n_layers)],
                        [rng.uniform(0, 1e6) for _ in range(n_layers)],
                        [rng.choice([0, 1e4, 1e6, 1e7]) for _ in range(n_layers)])
    memory = rng.choice([None, None, rng.uniform(1e6, 2e8)])
    return CostModel(lay, Topology(levels), rng.choice(["gpipe", "1f1b", "async", "2bw"]), rng.randint(1, 8),
                     rng.choice(["sgd", "adam"]), memory, rng.random() < 0.25)


@pytest.mark.parametrize("seed", range(200))
def test_dp_equals_exhaustive_search(seed: int) -> None:
    model = random_model(random.Random(seed))
    want = exhaustive(model)
    if want == INF:
        with pytest.raises(PlanningError):
            solve(model)
        return
    sol = solve(model)
    assert sol.objective_ms == pytest.approx(want, rel=1e-12)
    # The traced plan is a real plan of that cost, using every worker exactly once.
    assert evaluate(model, sol.tree) == pytest.approx(want, rel=1e-12)
    ranks = sorted(r for st in sol.stages for r in st.ranks)
    assert ranks == list(range(model.topology.workers))
    assert [s.start for s in sol.stages] == [0] + [s.end for s in sol.stages[:-1]]
    assert sol.stages[-1].end == model.num_layers


def uniform(n_layers: int, *, f: float = 1.0, params: float = 0.0, out: float = 0.0, act: float = 0.0) -> LayerCosts:
    return LayerCosts.of([f] * n_layers, [2 * f] * n_layers, [out] * n_layers, [act] * n_layers,
                         [params] * n_layers)


def test_straight_uniform_layers_split_evenly() -> None:
    model = CostModel(uniform(8), Topology.default(4), "1f1b", 4, straight=True)
    sol = solve(model)
    # The bound counts the flush: the last stage starts after 6 ms of forwards upstream, is busy 24 ms,
    # and its last gradient needs 12 ms of backwards upstream: (m + S - 1) x 6 ms, the 1f1b time. Other
    # splits tie on the bound; the simulator (through the search) picks the even one.
    assert sol.objective_ms == pytest.approx((4 + 4 - 1) * 6.0)
    profile = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 2.0, 0, 0, 0) for i in range(8)])
    plan = plan_from_profile(profile, 4, schedule="1f1b", microbatches=4, straight=True)
    assert [s.layers for s in plan.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert plan.predicted["step_ms"] == pytest.approx(42.0)


def test_heavy_parameters_over_slow_links_prefer_pipeline_light_ones_replicate() -> None:
    slow = Topology((Level(4, 1e6),))
    pipe = solve(CostModel(uniform(8, params=1e8), slow, "1f1b", 8))
    assert [len(s.ranks) for s in pipe.stages] == [1, 1, 1, 1]
    dp = solve(CostModel(uniform(8, out=1e8), slow, "1f1b", 8))
    assert [len(s.ranks) for s in dp.stages] == [4]


def test_hierarchical_ranks_pack_replicas_into_groups() -> None:
    # Big activations: a pipeline boundary across the slow level costs 40 ms per port, so each group holds
    # a whole replica (all-reduce 0.4 ms; no backward time to hide it in); inside a group the fast links
    # hide the boundary (0.4 ms < 24 ms compute), which beats in-group data parallelism by its all-reduce.
    topo = Topology.parse("2x100GB/s,2x1GB/s")
    lay = LayerCosts.of([3] * 4, [0] * 4, [1e7] * 4, [0] * 4, [1e5] * 4)
    sol = solve(CostModel(lay, topo, "1f1b", 4))
    assert sol.objective_ms == pytest.approx(12.4)
    assert [(s.start, s.end) for s in sol.stages] == [(0, 2), (2, 4)]
    assert [sorted(s.ranks) for s in sol.stages] == [[0, 2], [1, 3]]
    assert [s.factors for s in sol.stages] == [[1, 2], [1, 2]]
    assert topo.level_of(0, 1) == 0 and topo.level_of(1, 2) == 1


def test_flatten_nested_ranks() -> None:
    topo = Topology.parse("3x1GB/s,2x1GB/s")
    inner = Node(0, [(0, 1, 2, None), (1, 2, 1, None)])
    tree = Node(1, [(0, 2, 2, inner)])
    leaves = flatten(tree, topo)
    assert [sorted(s.ranks) for s in leaves] == [[0, 1, 3, 4], [2, 5]]
    assert [s.in_level for s in leaves] == [None, 0]


def test_memory_limit_forces_more_stages() -> None:
    # Boundaries (800 ms per port) cost more than the all-reduce (12 ms, hidden by the 16 ms last
    # backward): data parallel, unless memory forbids it.
    lay = uniform(8, params=1e6, out=1e8)
    topo = Topology.parse("4x1GB/s")
    free = solve(CostModel(lay, topo, "1f1b", 8, "sgd"))
    assert len(free.stages) == 1 and free.objective_ms == pytest.approx(48.0)
    # Data parallel holds all 8 layers' weights, gradients, momentum: 24 MB per worker.
    tight = CostModel(lay, topo, "1f1b", 8, "sgd", memory_per_worker=20e6)
    sol = solve(tight)
    assert len(sol.stages) > 1
    for st in sol.stages:
        r = len(st.ranks)
        down = sum(len(s.ranks) for s in sol.stages if s.start >= st.start)
        assert tight.memory_bytes(st.start, st.end, r, down) <= 20e6


def test_memory_per_schedule() -> None:
    lay = uniform(4, params=10.0, act=100.0)
    topo = Topology.default(4)
    mem = {s: float(CostModel(lay, topo, s, 8, "adam").memory_bytes(0, 2, 1, 4)) for s in ("gpipe", "1f1b",
                                                                                              "async", "2bw")}
    assert mem["gpipe"] == 20 * 4 + 8 * 200  # weights+grads+2 adam states, all 8 microbatches
    assert mem["1f1b"] == 20 * 4 + 4 * 200  # warmup_forwards + 1 = 4
    assert mem["async"] == 20 * (4 + 4) + 4 * 200  # plus a stashed version per in-flight microbatch
    assert mem["2bw"] == 20 * (4 + 2) + 4 * 200  # two copies beside the live weights, as stash.py holds them
    assert float(CostModel(lay, topo, "2bw", 8, "adam").memory_bytes(2, 4, 1, 1)) == 20 * (4 + 1) + 200  # last


def test_the_loss_memory_is_on_the_last_stage_only() -> None:
    """profile.loss_bytes (the loss's logits and gradients, forward to backward) adds to the peak of the stage
    holding the last layer, in the DP's memory and the simulator's alike."""
    lay = uniform(4, params=10.0, act=100.0)
    lay.loss_bytes = 5000.0
    model = CostModel(lay, Topology.default(4), "1f1b", 8, "adam")
    assert float(model.memory_bytes(2, 4, 1, 1)) == 20 * 4 + 200 + 5000  # the last two layers, the loss
    assert float(model.memory_bytes(0, 2, 1, 2)) == 20 * 4 + 2 * 200  # the first two: no loss
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 0, 100, 10) for i in range(4)]
    for loss, want in ((None, 0.0), (5000.0, 5000.0)):
        prof = Profile("m", {}, "cpu", "float32", 1, layers, loss_bytes=loss)
        plan = plan_from_profile(prof, 2, schedule="1f1b", microbatches=8, straight=True)
        peaks = plan.predicted["peak_memory_bytes"]
        assert peaks == [20 * 4 + 2 * 200, 20 * 4 + 200 + want], (loss, peaks)


def test_a_profile_timed_for_cuda_graphs_prices_their_static_tensors() -> None:
    """Under PIPEFLOW_CUDA_GRAPHS=1 every replayed action keeps its own static input and output (pipeflow/graphs.py):
    a stage holds, for each of its microbatches, the activation it receives and the gradient it sends back, its
    output and the gradient it gets for it. A profile timed so (timing "graphs") prices them, in the DP's memory
    and the simulator's alike; 2 x H200 measured +0.47-0.55 GiB a rank for these 0.5 GiB (benchmarks/gpu)."""
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 64, 100, 10) for i in range(6)]  # 64 output bytes a layer
    peaks = {}
    for timing in ("stage", "graphs"):
        prof = Profile("m", {}, "cuda", "float32", 1, layers, timing=timing)
        plan = plan_from_profile(prof, 3, schedule="1f1b", microbatches=8, straight=True)
        assert [st.layers for st in plan.stages] == [(0, 2), (2, 4), (4, 6)]
        peaks[timing] = plan.predicted["peak_memory_bytes"]
    extra = [b - a for a, b in zip(peaks["stage"], peaks["graphs"])]
    assert extra == [2 * 8 * 64, 2 * 8 * (64 + 64), 2 * 8 * 64]  # first: output only; middle: both; last: input
    lay = replace(uniform(6, params=10.0, out=64.0, act=100.0), graphs=True)
    model = CostModel(lay, Topology.default(3), "1f1b", 8, "adam")
    eager = CostModel(uniform(6, params=10.0, out=64.0, act=100.0), Topology.default(3), "1f1b", 8, "adam")
    for (i, j), want in zip([(0, 2), (2, 4), (4, 6)], extra):
        assert float(model.memory_bytes(i, j, 1, 6 - i)) - float(eager.memory_bytes(i, j, 1, 6 - i)) == want
    assert float(model.memory_bytes(2, 4, 2, 4)) - float(eager.memory_bytes(2, 4, 2, 4)) == 2 * 4 * 128  # 2 replicas


@pytest.mark.parametrize("text,bps", [("300GB/s", 300e9), ("25GiB/s", 25 * 2**30), ("100Gb/s", 12.5e9),
                                      ("1e9B/s", 1e9), ("10 GBps", 10e9)])
def test_parse_bandwidth(text: str, bps: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("text,n", [("16GB", 16 * 10**9), ("16GiB", 16 * 2**30), ("512MiB", 512 * 2**20),
                                    ("1e9", 10**9), ("2048", 2048), ("1.5G", 1.5e9)])
def test_parse_bytes(text: str, n: int) -> None:
    assert parse_bytes(text) == n


def test_topology_parse() -> None:
    topo = Topology.parse("8x300GB/s,4x25GB/s", 32)
    assert topo.workers == 32 and [lv.workers for lv in topo.levels] == [8, 4]
    assert topo.levels[1].bandwidth == 25e9
    assert str(topo) == "8x300GB/s,4x25GB/s"
    assert Topology.default(6).levels == (Level(6, 10e9),)


@pytest.mark.parametrize("text,workers,msg", [
    ("8x300GB/s,4x25GB/s", 16, "--workers 16 does not match --topology '8x300GB/s,4x25GB/s', which has 8x4 = 32"),
    ("8x300", 8, "--topology '8x300': bandwidth must look like 300GB/s"),
    ("eightx1GB/s", 8, "--topology must be comma-separated levels COUNTxBANDWIDTH"),
    ("0x1GB/s", 0, "--topology must be comma-separated levels"),
])
def test_topology_errors(text: str, workers: int, msg: str) -> None:
    with pytest.raises(TopologyError) as e:
        Topology.parse(text, workers)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_bad_sizes() -> None:
    with pytest.raises(TopologyError, match="--memory-per-worker must be a size such as 16GB"):
        parse_bytes("lots")


def test_straight_needs_enough_layers() -> None:
    with pytest.raises(PlanningError):
        solve(CostModel(uniform(3), Topology.default(4), "1f1b", 4, straight=True))


def test_speed_smoke() -> None:
    rng = np.random.default_rng(0)
    lay = LayerCosts.of(rng.uniform(1, 2, 64), rng.uniform(2, 4, 64), rng.uniform(0, 1e6, 64), rng.uniform(0, 1e6, 64),
                        rng.uniform(0, 1e7, 64))
    sol = solve(CostModel(lay, Topology.parse("4x100GB/s,4x10GB/s"), "1f1b", 16))
    assert sorted(r for s in sol.stages for r in s.ranks) == list(range(16))


def test_progress_reports_every_level_to_the_end() -> None:
    lines: list[str] = []
    tabulate(CostModel(uniform(6), Topology.parse("2x10GB/s,2x1GB/s"), "1f1b", 4), Progress(lines.append, every_s=0))
    assert lines[0].startswith("planning level 0: 1/6 first layers done, ")
    assert lines[5].startswith("planning level 0: 6/6 ") and lines[-1].startswith("planning level 1: 6/6 ")
    assert len(lines) == 12
    quiet: list[str] = []
    tabulate(CostModel(uniform(6), Topology.default(2), "1f1b", 4), Progress(quiet.append))
    assert quiet == []  # nothing under 5 s


def test_fan_in_is_charged_to_the_receiver() -> None:
    # Issue 13: three replicas feeding one worker (AlexNet 3-1 at 1 GB/s). The receiver takes all m = 6
    # activations of 44 MB through its one port: 6 x 44 ms, not 6 / 3 x 44 ms.
    lay = LayerCosts.of([0.1, 0.1], [0.2, 0.2], [44e6, 0.0], [0.0, 0.0], [0.0, 0.0])
    model = CostModel(lay, Topology.parse("4x1GB/s"), "async", 6)
    three_one = Node(0, [(0, 1, 3, None), (1, 2, 1, None)])
    assert evaluate(model, three_one) == pytest.approx(6 * 44.0)
    assert float(model.port_ms(1, None, 1, 0)) == pytest.approx(6 * 44.0)  # receiver's port
    assert float(model.port_ms(0, 1, 3, 0)) == pytest.approx(2 * 44.0)  # each sender's


def test_search_cut_short_still_answers_with_the_dp_optimum() -> None:
    # A search stopped by its limits (expansions, simulation budget) returns the best it priced, which
    # always includes the DP's own optimum: never "no plan" for lack of time.
    model = CostModel(uniform(12, out=1e6), Topology.parse("6x1GB/s"), "1f1b", 8)
    tables = tabulate(model)
    priced: list[int] = []

    def price(sol: Solution) -> float:  # far above every bound: only the limits can stop the search
        priced.append(len(sol.stages))
        return 1e9

    got = search(tables, price, expansions=0)
    assert priced == [len(solve(model).stages)] and got.exact is False and got.simulated == 1
    assert [(s.start, s.end) for s in got.solution.stages] == [(s.start, s.end) for s in solve(model).stages]


def naive_level(model: CostModel, level: int, inner: np.ndarray | None) -> np.ndarray:
    """best[w, i, j] of one inner level by the recurrence itself, every (w', k) tried. The costs of the stages
    [i, k) on w units (alone, or followed by another) do not depend on j: they are priced once per (i, w), for
    every k, and each j reads its own."""
    n, L = model.topology.levels[level].workers, model.num_layers
    best = np.full((n + 1, L + 1, L + 1), INF)
    for i in range(L - 1, -1, -1):
        for w in range(1, n + 1):
            ends = np.arange(i + 1, L + 1)
            alone = model.stage_row(level, i, ends, w, inner)[w - 1]  # [j - i - 1]: stage [i, j) on w units
            splits = model.split_row(level, i, ends[:-1], w, inner)  # [:, k - i - 1]: stage [i, k), then more
            for j in range(i + 1, L + 1):
                cand = float(alone[j - i - 1])
                if j > i + 1:
                    left = splits[:, :j - i - 1]  # k = i + 1 .. j - 1
                    for w1 in range(1, w):
                        cand = min(cand, float(np.maximum(left[w1 - 1], best[w - w1, i + 1:j, j]).min()))
                best[w, i, j] = cand
    return best


@pytest.mark.parametrize("seed", range(40))
def test_bands_equal_the_recurrence_on_edge_cases(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random small cases at the edges: 1 to 20 layers, compute all zero, tied or spanning 12 orders of magnitude,
    one or two units at a level, three levels, every schedule, --straight, memory limits that leave few stages or
    none, and the bands' knobs (block width, piece size, first guess, temporaries' size) at their extremes: the
    inner tables equal the plain recurrence exactly."""
    rng = random.Random(seed)
    n_layers = rng.choice([1, 2, 3, rng.randint(4, 20)])
    f = {"zero": [0.0] * n_layers, "ties": [float(rng.choice([0, 1, 2])) for _ in range(n_layers)],
         "wide": [10 ** rng.uniform(-6, 6) for _ in range(n_layers)],
         "uniform": [rng.uniform(0, 3) for _ in range(n_layers)]}[rng.choice(["zero", "ties", "wide", "uniform"])]
    lay = LayerCosts.of(f, [2 * x for x in f], [float(rng.choice([0, 1e5, 1e7])) for _ in range(n_layers)],
                        [rng.uniform(0, 1e6) for _ in range(n_layers)],
                        [float(rng.choice([0, 1e6, 1e7])) for _ in range(n_layers)], loss_ms=rng.choice([0.0, 1.0]))
    topo = Topology.parse(rng.choice(["2x10GB/s", "1x10GB/s,3x1GB/s", "2x10GB/s,2x1GB/s", "6x10GB/s,1x1GB/s",
                                      "4x100GB/s,3x10GB/s,2x1GB/s", "1x100GB/s,1x10GB/s,3x1GB/s"]))
    model = CostModel(lay, topo, rng.choice(["1f1b", "gpipe", "async", "2bw"]), rng.randint(1, 12), "adam", None,
                      rng.random() < 0.2)
    limit = rng.choice([None, None, 1.0, "some"])
    if limit == "some":  # between the memories of a few stages: many of them over it
        sample = [float(model.memory_bytes(i, rng.randint(i + 1, n_layers), 1, topo.workers))
                  for i in (rng.randrange(n_layers) for _ in range(20))]
        limit = float(np.quantile(sample, 0.5)) or 1.0
    model = replace(model, memory_per_worker=limit)
    monkeypatch.setattr(planner, "WIDTH", rng.choice([1, 2, 3, 32]))
    monkeypatch.setattr(bands, "CHUNK_ROWS", rng.choice([1, 3, 400]))
    monkeypatch.setattr(bands, "GUESS_SLACK", rng.choice([-0.9, 0.0, 0.01, 10.0]))
    monkeypatch.setattr(bands, "SMALL", rng.choice([1, 12_000]))
    inner = None
    for level, got in enumerate(tabulate(model).levels):
        np.testing.assert_array_equal(got.best, naive_level(model, level, inner))
        inner = got.table()


@pytest.mark.parametrize("seed, pieces", [(s, p) for s in range(6) for p in ("as shipped", "small", "guessed low")])
def test_banded_inner_table_equals_the_recurrence(seed: int, pieces: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bands (partitioner/bands.py) cut rows by two bounds and gather column blocks of every w at once: on ranges
    over two blocks long (with layers of no compute, where the bounds tie) the table equals the plain
    recurrence exactly. Also gathered in pieces of a few rows, and with every first cap guessed below the
    optimum (each block then gathers the rows its first band left out)."""
    if pieces == "small":
        monkeypatch.setattr(bands, "CHUNK_ROWS", 5)
    if pieces == "guessed low":
        monkeypatch.setattr(bands, "GUESS_SLACK", -0.5)
    rng = np.random.default_rng(seed)
    n_layers = 72
    f = rng.uniform(0, 3, n_layers) * (rng.random(n_layers) > 0.25)
    lay = LayerCosts.of(f, 2 * f, rng.choice([0, 1e5, 1e6], n_layers), rng.uniform(0, 1e6, n_layers),
                        rng.choice([0, 1e6, 1e7], n_layers), loss_ms=float(rng.uniform(0, 2)))
    topo = Topology.parse(["5x10GB/s,2x1GB/s", "3x100GB/s,2x10GB/s,2x1GB/s"][seed % 2])
    model = CostModel(lay, topo, ["1f1b", "gpipe", "async"][seed % 3], int(rng.integers(1, 12)), "adam",
                      [None, 5e7][seed % 2])
    tables = tabulate(model)
    inner = None
    for level, got in enumerate(tables.levels):
        np.testing.assert_array_equal(got.best, naive_level(model, level, inner))
        inner = got.table()
