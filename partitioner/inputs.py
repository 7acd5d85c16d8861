"""The planning service's checks of its inputs: worker count, microbatch count, virtual stages, topology and the
optimizer the profile timed (pure)."""
from __future__ import annotations

from partitioner.costmodel import PlanningError
from partitioner.jsonfile import show
from partitioner.profile import Profile
from partitioner.topology import Level, Topology, TopologyError
from pipeflow.kinds import DEFAULT_VIRTUAL_STAGES, TABLE

# Sizes the planner refuses up front rather than run for minutes: the DP grows as layers^2 x workers^2 on
# one level and the simulator linearly in microbatches x stages.
MAX_WORKERS = 1024
MAX_MICROBATCHES = 4096


def check_workers(workers: object, what: str = "--workers") -> None:
    """A worker count the planner takes; `what` names where it came from (a flag, or a plan file's field)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PlanningError(f"{what} must be a positive integer, found {workers!r}")
    if workers > MAX_WORKERS:
        raise PlanningError(f"{what} must be at most {MAX_WORKERS} (the planner's limit), found {show(workers)}")


def resolve_topology(workers: int, topology: Topology | str | None, profile: Profile | None = None) -> Topology:
    """The topology given, else one level at the profile's measured device-to-device bandwidth (CUDA
    with several GPUs), else Topology.default."""
    check_workers(workers)
    if isinstance(topology, str):
        topology = Topology.parse(topology, workers)
    if topology is None and profile is not None and profile.link_bandwidth:
        topology = Topology((Level(workers, profile.link_bandwidth),))
    topology = topology or Topology.default(workers)
    if topology.workers != workers:
        raise TopologyError(f"--workers {workers} does not match the topology {topology} "
                            f"({topology.workers} workers)")
    return topology


def check_microbatches(microbatches: object, what: str = "--microbatches") -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PlanningError(f"{what} must be a positive integer or 'auto', found {microbatches!r}")
    if microbatches > MAX_MICROBATCHES:
        raise PlanningError(f"{what} must be at most {MAX_MICROBATCHES} (the planner's limit), found "
                            f"{show(microbatches)}")


def virtual_stages(given: int | None, schedule: str) -> int:
    """--virtual-stages, else the schedule's default (DEFAULT_VIRTUAL_STAGES where chunks go round-robin, else 1);
    below 1, or above 1 under a schedule that does not interleave, refused as pipeflow-train refuses them."""
    chunked = [k.name for k in TABLE if k.chunk_order is not None]
    if given is not None and given < 1:
        raise PlanningError(f"--virtual-stages must be >= 1, found {given}")
    if given is not None and given > 1 and schedule not in chunked:
        raise PlanningError(f"--virtual-stages {given} needs a schedule that places chunks round-robin "
                            f"({', '.join(chunked)}), found --schedule {schedule}")
    return given if given is not None else DEFAULT_VIRTUAL_STAGES if schedule in chunked else 1


def check_optimizer(profile: Profile, optimizer: str, source: str = "the profile") -> None:
    """--optimizer among the updates the profile timed (optimizer_ms_per_byte); else its updates would be priced at 0
    and a slower optimizer would look the cheaper. A profile that timed none (made before the field, or of a model
    without parameters) prices every update at 0, as formats.md says."""
    timed = sorted(profile.optimizer_ms_per_byte)
    if timed and optimizer not in timed:
        flags = " or ".join(f"--optimizer {name}" for name in timed)
        raise PlanningError(f"--optimizer {optimizer}: {source} timed the update of {', '.join(timed)} only "
                            f"(optimizer_ms_per_byte), so {optimizer}'s updates would be priced at 0; plan with "
                            f"{flags}, or profile again with pipeflow-profile --optimizer {optimizer}")
