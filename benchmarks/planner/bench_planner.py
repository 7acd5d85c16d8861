"""Solve time of the partitioning DP (partitioner.planner.solve) over layers x workers x levels, and of the
whole default `pipeflow-plan` command (DP bounds + simulator search, --microbatches auto, no memory limit).

    python benchmarks/planner/bench_planner.py            # the tables in README.md
    python benchmarks/planner/bench_planner.py --quick    # the headline cases only
    python benchmarks/planner/bench_planner.py --profile  # where the default command's time goes
"""
from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import time

import numpy as np

from partitioner.planner import CostModel, LayerCosts, solve
from partitioner.profile import LayerProfile, Profile
from partitioner.service import plan_detailed
from partitioner.topology import Topology


def random_layers(n: int, seed: int = 0) -> LayerCosts:
    """Transformer-like: uneven compute, activations of ~1 MB, parameters of ~10 MB per layer."""
    rng = np.random.default_rng(seed)
    f = rng.uniform(0.5, 2.0, n)
    return LayerCosts.of(f, 2 * f, rng.uniform(0.5e6, 2e6, n), rng.uniform(2e6, 8e6, n), rng.uniform(5e6, 20e6, n))


def time_solve(layers: int, topology: str, *, repeats: int = 3,
               memory: float | None = 16e9) -> tuple[float, float, int]:
    """Best-of-`repeats` wall and CPU seconds of one solve (CPU time is robust to a busy shared machine)."""
    topo = Topology.parse(topology)
    model = CostModel(random_layers(layers), topo, "1f1b", 4 * topo.workers, "adam", memory)
    wall, cpu, stages = float("inf"), float("inf"), 0
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        sol = solve(model)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
        stages = len(sol.stages)
    return wall, cpu, stages


def random_profile(n: int, seed: int = 0) -> Profile:
    """random_layers as a profile.json would hold it (microbatch size 1)."""
    lay = random_layers(n, seed)
    return Profile("synthetic", {}, "cpu", "float32", 1,
                   [LayerProfile(f"l{i}", float(lay.forward_ms[i]), float(lay.backward_ms[i]), int(lay.output_bytes[i]),
                                 int(lay.activation_bytes[i]), int(lay.parameter_bytes[i])) for i in range(n)])


def time_default_command(layers: int, topology: str) -> tuple[float, float, str]:
    """Wall and CPU seconds of pipeflow-plan's work with default flags (1f1b, m auto, no memory limit)."""
    prof, topo = random_profile(layers), Topology.parse(topology)
    t0, c0 = time.perf_counter(), time.process_time()
    got = plan_detailed(prof, topo.workers, topology=topology)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    search = got.plan.extra["planner"]["search"]
    what = (f"m={got.plan.microbatches}, {len(got.plan.stages)} stage(s), {search['plans_simulated']} simulated, "
            f"exact={search['exact']}")
    return wall, cpu, what


DEFAULT_CASES = [(512, "8x300GB/s,8x25GB/s"), (512, "16x300GB/s,4x25GB/s"), (512, "64x1GB/s")]

CASES = [  # (layers, topology)
    (512, "8x300GB/s,8x25GB/s"),  # the headline: 512 layers x 64 workers x 2 levels
    (64, "8x300GB/s,8x25GB/s"), (128, "8x300GB/s,8x25GB/s"), (256, "8x300GB/s,8x25GB/s"),
    (512, "4x300GB/s,16x25GB/s"), (512, "16x300GB/s,4x25GB/s"), (512, "2x300GB/s,32x25GB/s"),
    (512, "8x300GB/s,2x25GB/s"), (512, "8x300GB/s,4x25GB/s"), (512, "8x300GB/s,16x25GB/s"),
    (128, "8x300GB/s"), (512, "8x300GB/s"), (512, "64x25GB/s"), (512, "4x300GB/s,4x50GB/s,4x25GB/s"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile the default command on the headline cases")
    args = p.parse_args()
    print(f"# {platform.processor() or platform.machine()}, numpy {np.__version__}, python {platform.python_version()}")
    if args.profile:
        for layers, topo in DEFAULT_CASES:
            prof = cProfile.Profile()
            prof.enable()
            time_default_command(layers, topo)
            prof.disable()
            print(f"## {layers} layers, {topo}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(8)
        return
    print("| layers | topology | default command wall s | CPU s | plan |")
    print("|---:|---|---:|---:|---|")
    for layers, topo in DEFAULT_CASES:
        wall, cpu, what = time_default_command(layers, topo)
        print(f"| {layers} | {topo} | {wall:.2f} | {cpu:.2f} | {what} |", flush=True)
    print()
    print("| layers | topology | workers | levels | wall s | CPU s | stages |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for layers, topo in CASES[:1] if args.quick else CASES:
        wall, cpu, stages = time_solve(layers, topo)
        t = Topology.parse(topo)
        print(f"| {layers} | {topo} | {t.workers} | {len(t.levels)} | {wall:.3f} | {cpu:.3f} | {stages} |",
              flush=True)


if __name__ == "__main__":
    main()
