"""A plan as the DP builds it: a tree of stages per topology level (Node), its flattened leaf stages with
their ranks (LeafStage, flatten), and its cost-model time computed directly (evaluate), which the DP's
tables must agree with (tests/test_partitioner_planner.py)."""
from __future__ import annotations

from dataclasses import dataclass

from partitioner.costmodel import INF, CostModel
from partitioner.topology import Topology


@dataclass
class Node:
    """A plan of layers on one group of `level`: stages (start, end, units, child plan on one unit)."""

    level: int
    stages: list[tuple[int, int, int, Node | None]]


@dataclass
class LeafStage:
    """A stage of the flattened plan: layers [start, end), its ranks, its replica factor per level, and the
    level its input boundary crosses (None for the first stage)."""

    start: int
    end: int
    ranks: list[int]
    factors: list[int]
    in_level: int | None


@dataclass
class Solution:
    objective_ms: float
    tree: Node
    stages: list[LeafStage]


def evaluate(model: CostModel, node: Node) -> float:
    """The cost-model time of a plan tree, computed directly (the DP must agree with it)."""
    levels = model.topology.levels
    outside = 0 if len(levels) == 1 else model.outside(0)
    total = sum(u for _, _, u, _ in node.stages)
    worst, left = 0.0, total
    for t, (a, b, u, child) in enumerate(node.stages):
        if child is None:
            unit = model.microbatches * float(model.stage_compute_ms(a, b))
        else:
            unit = evaluate(model, child)
        cost = float(model.stage_ms(unit, a, b, u, node.level))
        cost = max(cost, float(model.port_ms(a, b if t < len(node.stages) - 1 else None, u, node.level)))
        if model.straight and u > 1:
            cost = INF
        if node.level == 0 and model.memory_per_worker is not None:
            if float(model.memory_bytes(a, b, u, left + outside)) > model.memory_per_worker:
                cost = INF
        worst = max(worst, cost)
        left -= u
    return worst


def flatten(tree: Node, topology: Topology) -> list[LeafStage]:
    """Leaf stages in layer order with their ranks: a node's stages take consecutive units of each group
    it is replicated on, so replicas and neighbours share the fastest level the plan allows."""
    leaves: list[LeafStage] = []
    k = len(topology.levels)

    def walk(node: Node, bases: list[int], factors: list[int], in_level: int | None) -> None:
        size = topology.unit_size(node.level)
        offset = 0
        for t, (a, b, u, child) in enumerate(node.stages):
            units = [base + (offset + x) * size for base in bases for x in range(u)]
            f = factors.copy()
            f[node.level] = u
            lvl = in_level if t == 0 else node.level
            if child is None:
                leaves.append(LeafStage(a, b, units, f, lvl))
            else:
                walk(child, units, f, lvl)
            offset += u

    walk(tree, [0], [1] * k, None)
    return leaves
