"""pipeflow's plans on PipeDream's published profiles, next to the configurations PipeDream's repository runs.

    git clone https://github.com/msr-fiddle/pipedream /tmp/pipedream   # MIT; not vendored here
    python benchmarks/planner/pipedream_compare.py /tmp/pipedream        # prints the table of pipedream.md

For each case: graph.txt -> profile.json (partitioner.pipedream), pipeflow's plan for the async schedule
(PipeDream's 1F1B with weight stashing) on the topology below, and PipeDream's configuration from
runtime/<task>/models/<model>/gpus=N/hybrid_conf.json + stageK.py, priced by the same cost model
(partitioner.service.evaluate_plan). Stage k of PipeDream's runtime is mapped onto the linearised profile by its
modules (`self.layerN = torch.nn.X(...)`), matched in order by class name; parameter-free glue between two
stages' modules (__getitem__, Add, View) goes to the earlier stage.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from partitioner.pipedream import convert
from partitioner.plan import Plan, StagePlan
from partitioner.profile import Profile
from partitioner.service import Planned, evaluate_plan, plan_detailed

# (model, graph.txt, runtime config dir, workers, topology, samples per profiled minibatch: the Input node's
# bytes / (3*224*224*4) for the image models; not recoverable for GNMT, recorded as 1)
# Topologies from the PipeDream paper (SOSP'19, section 5.1): Cluster-A, 4 V100 per server on PCIe, 10 Gbps
# Ethernet between servers. The paper gives no PCIe figure: 10 GB/s (PCIe 3.0 x16, one direction) is assumed.
CASES = [
    ("VGG-16", "profiler/image_classification/profiles/vgg16/graph.txt",
     "runtime/image_classification/models/vgg16/gpus=16", 16, "4x10GB/s,4x1.25GB/s", 128),
    ("AlexNet", "profiler/image_classification/profiles/alexnet/graph.txt",
     "runtime/image_classification/models/alexnet/gpus=4", 4, "4x10GB/s", 256),
    ("GNMT-8", "profiler/translation/profiles/gnmt/graph.txt",
     "runtime/translation/models/gnmt/gpus=12", 12, "4x10GB/s,3x1.25GB/s", 1),
    ("GNMT-16", "profiler/translation/profiles/gnmt_large/graph.txt",
     "runtime/translation/models/gnmt_large/gpus=16", 16, "4x10GB/s,4x1.25GB/s", 1),
]
FLAT = "1GB/s"  # optimizer_graph_hierarchical.py --network_bandwidths default (1e9 bytes/s)
MODULE = re.compile(r"self\.layer\d+ = (?:torch\.nn\.)?([A-Za-z_][A-Za-z_0-9]*)\(")


def _cls(desc: str) -> str:
    return desc.split("(")[0].strip()


def pipedream_plan(profile: Profile, conf_dir: Path, workers: int, schedule: str) -> Plan:
    """PipeDream's configuration as a pipeflow Plan over the linearised profile."""
    conf = json.loads((conf_dir / "hybrid_conf.json").read_text())
    ranks = {int(k): v for k, v in conf["stage_to_rank_map"].items()}
    stage_modules = [MODULE.findall((conf_dir / f"stage{k}.py").read_text()) for k in range(len(ranks))]
    classes = {c for mods in stage_modules for c in mods}
    names = [layer.name.split(": ", 1)[1] for layer in profile.layers]
    module_pos = [i for i, n in enumerate(names) if _cls(n) in classes]
    want = [c for mods in stage_modules for c in mods]
    have = [_cls(names[i]) for i in module_pos]
    if want != have:
        raise SystemExit(f"{conf_dir}: the stages' modules {want} do not match the profile's {have}")
    stages, start, k = [], 0, 0
    for s, mods in enumerate(stage_modules):
        k += len(mods)
        end = module_pos[k] if k < len(module_pos) else len(names)  # up to the next stage's first module
        stages.append(StagePlan((start, end), len(ranks[s]), sorted(ranks[s])))
        start = end
    reps = [st.replicas for st in stages]
    lcm = math.lcm(*reps)
    m = lcm * math.ceil(workers / lcm)  # async: every replica count divides m
    return Plan(schedule, m, workers, stages)


def describe(plan: Plan) -> str:
    reps = [st.replicas for st in plan.stages]
    if all(r == 1 for r in reps):
        return f"straight {len(reps)}"
    return "-".join(map(str, reps))


def row(name: str, planned: Planned, profile: Profile) -> str:
    """One table row; ms per minibatch = predicted step / m (comparable across m for async)."""
    p = planned.plan
    per_mb = p.predicted["step_ms"] / p.microbatches
    bounds = ",".join(str(st.layers[1]) for st in p.stages[:-1]) or "-"
    search = p.extra.get("planner", {}).get("search")
    found = "evaluated" if search is None else (f"bound {search['bound_ms']:.0f} ms, "
                                                 f"{search['plans_simulated']} simulated")
    return (f"| {name} | {describe(p)} | {bounds} | {p.microbatches} | {per_mb:.2f} | {found} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pipedream", help="a checkout of msr-fiddle/pipedream")
    ap.add_argument("--schedule", default="async")
    ap.add_argument("--save", default=None, help="folder to write each converted profile.json into")
    args = ap.parse_args()
    root = Path(args.pipedream)
    print("| model / plan | replicas per stage | cuts after layer | m | ms per minibatch | search |")
    print("|---|---|---|---|---|---|")
    for name, graph, conf, workers, topo, mb in CASES:
        g = root / graph
        profile = convert(g.read_text(), model=name, microbatch_size=mb, source=graph)
        if args.save:
            out = Path(args.save) / g.parent.name / "profile.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            profile.save(out)
        ours = plan_detailed(profile, workers, schedule=args.schedule, microbatches="auto", topology=topo)
        pd = pipedream_plan(profile, root / conf, workers, args.schedule)
        theirs = evaluate_plan(profile, pd, topology=topo)
        at_m = plan_detailed(profile, workers, schedule=args.schedule, microbatches=pd.microbatches, topology=topo)
        print(f"| **{name}**, {workers} workers, {topo}, {len(profile.layers)} layers | | | | | |")
        print(row("pipeflow, m auto", ours, profile))
        print(row("pipeflow, PipeDream's m", at_m, profile))
        print(row("PipeDream's config", theirs, profile))
        # PipeDream's optimizer sees one level of `workers` at -b (default 1 GB/s): no host boundaries.
        flat = f"{workers}x{FLAT}"
        ours_flat = plan_detailed(profile, workers, schedule=args.schedule, microbatches=pd.microbatches,
                                  topology=flat)
        theirs_flat = evaluate_plan(profile, pd, topology=flat)
        print(row(f"pipeflow, PipeDream's m, {flat}", ours_flat, profile))
        print(row(f"PipeDream's config, {flat}", theirs_flat, profile))


if __name__ == "__main__":
    main()
