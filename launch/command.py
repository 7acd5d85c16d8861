"""The mpirun argv for a plan, from workers, hosts, MPI flavour and environment; pure."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from launch.hosts import Host, check_slots, format_hosts

Flavour = Literal["mpich", "openmpi"]
FLAVOURS: tuple[Flavour, ...] = ("mpich", "openmpi")

# Set in the launcher's environment -> passed on to every rank (remote ranks do not inherit it).
PASSTHROUGH_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                   "MPI4PY_LIBMPI", "PYTHONPATH")


class LaunchError(ValueError):
    """Launcher input that cannot make a command; the message says what was expected and found."""


def rank_env(*, environ: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """What every rank gets: PYTHONUNBUFFERED=1, the PASSTHROUGH_ENV names that are set, then `extra` (--env)."""
    env = {"PYTHONUNBUFFERED": "1"}
    env.update({k: environ[k] for k in PASSTHROUGH_ENV if k in environ})
    env.update(extra)
    return env


def train_command(program: Sequence[str], plan_path: str, train_args: Sequence[str]) -> list[str]:
    """`program --plan PLAN train_args...`; the plan is the launcher's, so train_args may not name one."""
    if any(a == "--plan" or a.startswith("--plan=") for a in train_args):
        raise LaunchError(f"the train arguments {list(train_args)} contain --plan, but pipeflow-launch passes "
                          f"--plan {plan_path} itself: remove it after --")
    return [*program, "--plan", plan_path, *train_args]


def mpirun_command(*, mpirun: str, flavour: Flavour, workers: int, hosts: Sequence[Host] | None,
                   env: Mapping[str, str], program: Sequence[str], as_root: bool = False,
                   cpu_count: int | None = None) -> list[str]:
    """`mpirun -np N [hosts] [env] program...`; hosts=None runs every rank on this machine."""
    if workers < 1:
        raise LaunchError(f"the plan has {workers} workers, expected at least 1")
    if hosts is not None:
        check_slots(hosts, workers)
    argv = [mpirun, "-np", str(workers)]
    if flavour == "mpich":  # Hydra: -hosts NAME:PROCS,...; -genv NAME VALUE
        if hosts is not None:
            argv += ["-hosts", format_hosts(hosts)]
        for name, value in env.items():
            argv += ["-genv", name, value]
    elif flavour == "openmpi":
        if as_root:
            argv.append("--allow-run-as-root")
        # Open MPI refuses more local ranks than cores unless told; Hydra just runs them.
        if hosts is None and cpu_count is not None and workers > cpu_count:
            argv.append("--oversubscribe")
        if hosts is not None:
            argv += ["--host", format_hosts(hosts)]
        for name, value in env.items():
            argv += ["-x", f"{name}={value}"]
    else:
        raise LaunchError(f"MPI flavour {flavour!r} is unknown, expected one of {', '.join(FLAVOURS)}")
    return [*argv, *program]
