"""The planning service's checks of its inputs: worker count, microbatch count and topology (pure)."""
from __future__ import annotations

from partitioner.costmodel import PlanningError
from partitioner.profile import Profile
from partitioner.topology import Level, Topology, TopologyError

# Sizes the planner refuses up front rather than run for minutes: the DP grows as layers^2 x workers^2 on
# one level and the simulator linearly in microbatches x stages.
MAX_WORKERS = 1024
MAX_MICROBATCHES = 4096


def resolve_topology(workers: int, topology: Topology | str | None, profile: Profile | None = None) -> Topology:
    """The topology given, else one level at the profile's measured device-to-device bandwidth (CUDA
    with several GPUs), else Topology.default."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PlanningError(f"--workers must be a positive integer, found {workers!r}")
    if workers > MAX_WORKERS:
        raise PlanningError(f"--workers must be at most {MAX_WORKERS} (the planner's limit), found {workers}")
    if isinstance(topology, str):
        topology = Topology.parse(topology, workers)
    if topology is None and profile is not None and profile.link_bandwidth:
        topology = Topology((Level(workers, profile.link_bandwidth),))
    topology = topology or Topology.default(workers)
    if topology.workers != workers:
        raise TopologyError(f"--workers {workers} does not match the topology {topology} "
                            f"({topology.workers} workers)")
    return topology


def check_microbatches(microbatches: object) -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PlanningError(f"--microbatches must be a positive integer or 'auto', found {microbatches!r}")
    if microbatches > MAX_MICROBATCHES:
        raise PlanningError(f"--microbatches must be at most {MAX_MICROBATCHES} (the planner's limit), "
                            f"found {microbatches}")
