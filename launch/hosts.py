"""`--hosts h1:4,h2:4` (NAME[:SLOTS], slots default 1) to an ordered host list."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_SYNTAX = "expected NAME[:SLOTS],... e.g. h1:4,h2:4"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_SLOTS = re.compile(r"[0-9]+")


class HostsError(ValueError):
    """A --hosts value that does not parse, or that has too few slots for the plan."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int = 1

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def parse_hosts(spec: str) -> list[Host]:
    """Hosts in the order given; ranks fill them in that order (0..slots-1 on the first, ...)."""
    hosts: list[Host] = []
    for entry in spec.split(","):
        name, sep, slots = entry.strip().partition(":")
        if not name:
            raise HostsError(f"--hosts entry {entry!r}: empty host name ({_SYNTAX})")
        if not _NAME.fullmatch(name):
            raise HostsError(f"--hosts entry {entry!r}: host name {name!r} may only contain letters, digits, "
                             f"'.', '-' and '_' ({_SYNTAX})")
        if sep and (not _SLOTS.fullmatch(slots) or int(slots) < 1):
            raise HostsError(f"--hosts entry {entry!r}: slots must be a positive integer, found {slots!r} ({_SYNTAX})")
        if any(h.name == name for h in hosts):
            raise HostsError(f"--hosts lists {name!r} twice: give each host once, with its total slots")
        hosts.append(Host(name, int(slots) if sep else 1))
    return hosts


def format_hosts(hosts: Sequence[Host]) -> str:
    """The `h1:4,h2:4` form both MPICH's -hosts and Open MPI's --host take."""
    return ",".join(str(h) for h in hosts)


def check_slots(hosts: Sequence[Host], workers: int) -> None:
    total = sum(h.slots for h in hosts)
    if total < workers:
        plural = "" if total == 1 else "s"
        raise HostsError(f"--hosts {format_hosts(hosts)} gives {total} slot{plural} but the plan needs {workers} "
                         "workers: add hosts or slots (NAME:SLOTS)")
