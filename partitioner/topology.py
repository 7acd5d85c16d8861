"""Hierarchical worker topology (`8x300GB/s,4x25GB/s`) and byte/bandwidth quantities with unit suffixes."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from partitioner.profile import MIN_BANDWIDTH

# Default when --topology is not given: one flat level at 10 GB/s, roughly 100 Gb/s Ethernet/InfiniBand
# between hosts; pass --topology for NVLink-class links inside a host.
DEFAULT_BANDWIDTH = 10e9  # bytes/s

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?([bB])?\s*$")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?(B|b|bit)?(?:/s|ps)\s*$")


class TopologyError(ValueError):
    """A --topology, --workers or size value that cannot be used; the message shows the value."""


def parse_bytes(text: str, *, what: str = "--memory-per-worker") -> int:
    """`16GB` = 16e9, `16GiB` = 16*2**30, `512MiB`, `1e9`, `2048` (bytes)."""
    m = _QUANTITY.match(str(text))
    if not m:
        raise TopologyError(f"{what} must be a size such as 16GB, 16GiB, 512MiB or 1e9, found {text!r}")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if not math.isfinite(value):  # 1e400 parses as inf
        raise TopologyError(f"{what} must be a finite size such as 16GB, found {text!r}")
    if value <= 0:
        raise TopologyError(f"{what} must be positive, found {text!r}")
    return int(value)


def parse_bandwidth(text: str) -> float:
    """Bytes/s of `300GB/s`, `25GiB/s`, `100Gb/s` (bits: /8), `1e10B/s`."""
    m = _RATE.match(text)
    if not m:
        raise TopologyError(f"bandwidth must look like 300GB/s, 25GiB/s or 100Gb/s, found {text!r}")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if m.group(3) in ("b", "bit"):
        value /= 8
    if not math.isfinite(value):  # 1e400 parses as inf: an infinitely fast link hides every transfer
        raise TopologyError(f"bandwidth must be a finite rate such as 300GB/s, found {text!r}")
    if value <= 0:
        raise TopologyError(f"bandwidth must be positive, found {text!r}")
    if value < MIN_BANDWIDTH:  # a slip of the unit: 1e-30GB/s would price a step at 1e27 ms
        raise TopologyError(f"bandwidth must be at least 1kB/s (every network link is faster), found {text!r}")
    return value


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_bandwidth(bps: float) -> str:
    return f"{bps / 1e9:g}GB/s"


@dataclass(frozen=True)
class Level:
    """`workers` units per group at this level, linked at `bandwidth` bytes/s; level 0's units are workers,
    level k's units are the groups of level k-1."""

    workers: int
    bandwidth: float


@dataclass(frozen=True)
class Topology:
    """Levels from the innermost (fastest) out; workers = product of the levels' group sizes."""

    levels: tuple[Level, ...]

    def __post_init__(self) -> None:
        if not self.levels:
            raise TopologyError("a topology needs at least one level")
        for k, lv in enumerate(self.levels):
            if lv.workers < 1 or not MIN_BANDWIDTH <= lv.bandwidth < math.inf:
                raise TopologyError(f"topology level {k} needs workers >= 1 and a finite bandwidth >= 1kB/s, found "
                                    f"{lv.workers}x{lv.bandwidth:g}B/s")

    @property
    def workers(self) -> int:
        n = 1
        for lv in self.levels:
            n *= lv.workers
        return n

    def unit_size(self, level: int) -> int:
        """Workers in one unit of `level` (1 at level 0)."""
        n = 1
        for lv in self.levels[:level]:
            n *= lv.workers
        return n

    def level_of(self, a: int, b: int) -> int:
        """The lowest level whose group holds both ranks (ranks are packed level by level)."""
        for k in range(len(self.levels)):
            size = self.unit_size(k + 1)
            if a // size == b // size:
                return k
        return len(self.levels) - 1

    def __str__(self) -> str:
        return ",".join(f"{lv.workers}x{format_bandwidth(lv.bandwidth)}" for lv in self.levels)

    @classmethod
    def default(cls, workers: int) -> Topology:
        return cls((Level(workers, DEFAULT_BANDWIDTH),))

    @classmethod
    def parse(cls, text: str, workers: int | None = None) -> Topology:
        """`8x300GB/s,4x25GB/s`: groups of 8 at 300 GB/s, 4 such groups at 25 GB/s."""
        levels = []
        for part in text.split(","):
            count, sep, rate = part.strip().partition("x")
            if not sep or not count.strip().isascii() or not count.strip().isdigit() or int(count) < 1:
                raise TopologyError(f"--topology must be comma-separated levels COUNTxBANDWIDTH such as "
                                    f"8x300GB/s,4x25GB/s (innermost first), found {text!r}")
            try:
                bw = parse_bandwidth(rate)
            except TopologyError as e:
                raise TopologyError(f"--topology {text!r}: {e}") from None
            levels.append(Level(int(count), bw))
        topo = cls(tuple(levels))
        if workers is not None and workers != topo.workers:
            sizes = "x".join(str(lv.workers) for lv in levels)
            raise TopologyError(f"--workers {workers} does not match --topology {text!r}, which has "
                                f"{sizes} = {topo.workers} workers")
        return topo
