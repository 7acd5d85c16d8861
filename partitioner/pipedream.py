"""PipeDream's profiles (msr-fiddle/pipedream, profiler/*/profiles/*/graph.txt) as pipeflow profile.json.

    python -m partitioner.pipedream graph.txt -o profile.json [--microbatch-size 64] [--model vgg16]

graph.txt (PipeDream's graph/graph.py, `Graph.__str__`): one line per node,
    `ID -- DESC -- forward_compute_time=MS, backward_compute_time=MS, activation_size=BYTES, parameter_size=BYTES`
(activation_size may be a list `[a; b]`, summed as PipeDream does; an optional `-- stage_id=N` is ignored), and one
tab-indented line `\tSRC -- DST` per edge. Times are ms per minibatch, sizes bytes.

The conversion does what PipeDream's optimizer (optimizer/optimizer_graph_hierarchical.py, main) does before it
solves: "Input" sources are dropped (their time is data loading, and the input always sits in stage 0) and unused
`__getitem__` sinks are dropped. Then:
- a chain maps node by node: forward_ms, backward_ms, parameter_bytes as measured; activation_bytes (what a stage
  stashes) = the node's activation_size, as PipeDream sums it over a stage; output_bytes = the node's
  activation_size (what crosses a cut after it);
- a DAG is linearised in topological order (ties broken by the profiler's node numbering, i.e. execution order),
  and output_bytes of position i = the bytes crossing the cut after i: the activation_size of every node at or
  before i with an edge to a node after i, each such node counted once (a tensor is sent once per cut however
  many later nodes read it; this is PipeDream's antichain `output_activation_size`). The last layer's output_bytes
  is its own activation_size (what the loss reads), as for a chain.
Only the cuts of the linear order are offered to the planner: PipeDream's antichain DAG also offers cuts that a
different topological order would give; for the chains and near-chains of VGG, AlexNet and GNMT both are the same
set.
"""
from __future__ import annotations

import argparse
import heapq
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from partitioner.profile import LayerProfile, Profile, ProfileError


class PipeDreamError(ValueError):
    """A graph.txt that does not parse; the one-line message names the line."""


@dataclass
class Node:
    """One node of PipeDream's graph (times in ms, sizes in bytes)."""

    node_id: str
    desc: str
    forward_ms: float
    backward_ms: float
    activation_bytes: float
    parameter_bytes: float


_METADATA = re.compile(r"forward_compute_time=(?P<f>[^,]+), backward_compute_time=(?P<b>[^,]+), "
                       r"activation_size=(?P<a>\[[^\]]*\]|[^,]+), parameter_size=(?P<p>[^,\s]+)$")


def _number(text: str, what: str, where: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise PipeDreamError(f"{where}: {what} must be a number, found {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise PipeDreamError(f"{where}: {what} must be a non-negative finite number, found {text!r}")
    return v


def _parse_node(line: str, where: str) -> Node:
    tokens = line.strip().split(" -- ")
    if len(tokens) not in (3, 4):
        raise PipeDreamError(f"{where}: expected 'ID -- DESC -- forward_compute_time=..., backward_compute_time=..., "
                             f"activation_size=..., parameter_size=...', found {line.strip()[:80]!r}")
    node_id, desc, meta = tokens[0], tokens[1], tokens[2]
    m = _METADATA.match(meta.strip())
    if m is None:
        raise PipeDreamError(f"{where}: expected 'forward_compute_time=..., backward_compute_time=..., "
                             f"activation_size=..., parameter_size=...', found {meta.strip()[:80]!r}")
    act = m["a"].strip()
    if act.startswith("["):
        parts = [x for x in act[1:-1].split(";") if x.strip()]
        activation = sum(_number(x.strip(), "activation_size", where) for x in parts)
    else:
        activation = _number(act, "activation_size", where)
    return Node(node_id, desc, _number(m["f"], "forward_compute_time", where),
                _number(m["b"], "backward_compute_time", where), activation,
                _number(m["p"], "parameter_size", where))


def parse_graph(text: str, source: str = "graph.txt") -> tuple[dict[str, Node], list[tuple[str, str]]]:
    """Nodes (in file order) and edges of a graph.txt."""
    nodes: dict[str, Node] = {}
    edges: list[tuple[str, str]] = []
    for k, line in enumerate(text.splitlines(), 1):
        where = f"{source}:{k}"
        if not line.strip():
            continue
        if line.startswith("\t"):
            ends = line.strip().split(" -- ")
            if len(ends) != 2:
                raise PipeDreamError(f"{where}: expected an edge '\\tSRC -- DST', found {line.strip()[:80]!r}")
            edges.append((ends[0], ends[1]))
        else:
            node = _parse_node(line, where)
            if node.node_id in nodes:
                raise PipeDreamError(f"{where}: node {node.node_id!r} is defined twice")
            nodes[node.node_id] = node
    for src, dst in edges:
        for end in (src, dst):
            if end not in nodes:
                raise PipeDreamError(f"{source}: edge {src} -- {dst} names node {end!r}, which has no line")
    if not nodes:
        raise PipeDreamError(f"{source}: no nodes: expected PipeDream's graph.txt (one line per node)")
    return nodes, edges


def _natural(node_id: str) -> tuple[tuple[int, object], ...]:
    """node2 before node10: the profiler numbers nodes in execution order."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", node_id) if p)


def _prune(nodes: dict[str, Node], edges: list[tuple[str, str]]) -> tuple[list[str], list[tuple[str, str]]]:
    """Drop Input sources and unused __getitem__ sinks, as PipeDream's optimizer does."""
    has_in = {d for _, d in edges}
    has_out = {s for s, _ in edges}
    drop = {n for n, node in nodes.items() if n not in has_in and node.desc.startswith("Input")}
    drop |= {n for n, node in nodes.items() if n not in has_out and node.desc.startswith("__getitem__")}
    kept = [n for n in nodes if n not in drop]
    if not kept:
        raise PipeDreamError("graph has only Input and __getitem__ nodes: nothing to partition")
    return kept, [(s, d) for s, d in edges if s not in drop and d not in drop]


def linearise(nodes: dict[str, Node], edges: list[tuple[str, str]], source: str = "graph.txt") -> list[str]:
    """A topological order; among ready nodes the lowest node number first. Refuses a cycle."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    indeg = dict.fromkeys(nodes, 0)
    for s, d in edges:
        succ[s].append(d)
        indeg[d] += 1
    ready = [(_natural(n), n) for n, k in indeg.items() if k == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for d in succ[n]:
            indeg[d] -= 1
            if indeg[d] == 0:
                heapq.heappush(ready, (_natural(d), d))
    if len(order) != len(nodes):
        stuck = sorted((n for n in nodes if indeg[n] > 0), key=_natural)
        raise PipeDreamError(f"{source}: the graph has a cycle through {', '.join(stuck[:5])}: expected a DAG")
    return order


def cut_bytes(order: list[str], nodes: dict[str, Node], edges: list[tuple[str, str]]) -> list[float]:
    """cut_bytes[i]: bytes crossing the cut after order[i]; each sending node counted once. The last entry is the
    last node's own activation_size (its output, read by the loss)."""
    pos = {n: i for i, n in enumerate(order)}
    last_use = {n: pos[n] for n in order}
    for s, d in edges:
        last_use[s] = max(last_use[s], pos[d])
    out = []
    for i in range(len(order) - 1):
        out.append(sum(nodes[n].activation_bytes for n in order[:i + 1] if last_use[n] > i))
    out.append(nodes[order[-1]].activation_bytes)
    return out


def convert(text: str, *, model: str, microbatch_size: int = 1, source: str = "graph.txt") -> Profile:
    """graph.txt text -> pipeflow Profile (one layer per kept node, in linear order)."""
    nodes, edges = parse_graph(text, source)
    kept, kept_edges = _prune(nodes, edges)
    sub = {n: nodes[n] for n in kept}
    order = linearise(sub, kept_edges, source)
    outs = cut_bytes(order, sub, kept_edges)
    layers = [LayerProfile(f"{n}: {sub[n].desc}"[:120], sub[n].forward_ms, sub[n].backward_ms, round(outs[i]),
                           round(sub[n].activation_bytes), round(sub[n].parameter_bytes))
              for i, n in enumerate(order)]
    return Profile(model, {"source": "PipeDream graph.txt", "file": source, "nodes": len(nodes),
                           "edges": len(edges), "chain": _is_chain(order, kept_edges)},
                   "pipedream", "float32", microbatch_size, layers)


def _is_chain(order: list[str], edges: list[tuple[str, str]]) -> bool:
    return sorted(edges) == sorted(zip(order, order[1:]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m partitioner.pipedream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graph", help="PipeDream's graph.txt")
    p.add_argument("-o", "--output", required=True, help="profile.json to write")
    p.add_argument("--model", default=None, help="model name (default: the graph's folder name)")
    p.add_argument("--microbatch-size", type=int, default=1,
                   help="samples per profiled minibatch, recorded in profile.json (default 1)")
    args = p.parse_args(argv)
    if args.microbatch_size < 1:
        print(f"pipedream: error: --microbatch-size must be a positive integer, found {args.microbatch_size}",
              file=sys.stderr)
        return 2
    path = Path(args.graph)
    try:
        text = path.read_text()
        profile = convert(text, model=args.model or path.resolve().parent.name or "pipedream",
                          microbatch_size=args.microbatch_size, source=path.name)
        profile.save(args.output)
    except (PipeDreamError, ProfileError, OSError, UnicodeDecodeError) as e:
        print(f"pipedream: error: {e}", file=sys.stderr)
        return 2
    kind = "chain" if profile.model_args["chain"] else "DAG, linearised"
    print(f"{len(profile.layers)} layers ({kind}) from {args.graph}; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
