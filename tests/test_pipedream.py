"""partitioner.pipedream: PipeDream's graph.txt -> profile.json (chains exactly, DAGs linearised with cut bytes)."""
from __future__ import annotations

import json

import pytest

from partitioner import pipedream
from partitioner.cli import main as plan_main
from partitioner.profile import Profile


def _node(i: int, desc: str, f: float, b: float, act: str, par: float) -> str:
    return (f"node{i} -- {desc} -- forward_compute_time={f:.3f}, backward_compute_time={b:.3f}, "
            f"activation_size={act}, parameter_size={par:.3f}")


# Written in PipeDream's Graph.__str__ format: nodes in arbitrary order, edges tab-indented.
CHAIN = "\n".join([
    _node(3, "Linear(in_features=8, out_features=2, bias=True)", 0.5, 1.0, "64.000", 72.0),
    _node(1, "Input", 635.9, 0.0, "4096.000", 0.0),
    _node(2, "Conv2d(3, 8, kernel_size=(3, 3))", 2.0, 4.0, "[1000.000; 24.000]", 896.0),
    _node(10, "ReLU(inplace)", 0.25, 0.125, "1024.000", 0.0),
    "\tnode1 -- node2", "\tnode2 -- node10", "\tnode10 -- node3",
]) + "\n"

# A -> B, A -> C, B -> D, C -> D (a residual block), plus a __getitem__ sink PipeDream drops.
DIAMOND = "\n".join([
    _node(1, "Input", 9.0, 0.0, "5.000", 0.0),
    _node(2, "A", 1.0, 2.0, "100.000", 10.0),
    _node(3, "B", 1.0, 2.0, "30.000", 20.0),
    _node(4, "C", 1.0, 2.0, "7.000", 30.0),
    _node(5, "D", 1.0, 2.0, "2.000", 40.0),
    _node(6, "__getitem__(0)", 0.0, 0.0, "1.000", 0.0),
    "\tnode1 -- node2", "\tnode2 -- node3", "\tnode2 -- node4", "\tnode3 -- node5", "\tnode4 -- node5",
    "\tnode5 -- node6",
]) + "\n"


def test_chain_maps_node_by_node_in_execution_order() -> None:
    p = pipedream.convert(CHAIN, model="tiny")
    assert [x.name.split(":")[0] for x in p.layers] == ["node2", "node10", "node3"]  # Input dropped
    assert [x.forward_ms for x in p.layers] == [2.0, 0.25, 0.5]
    assert [x.backward_ms for x in p.layers] == [4.0, 0.125, 1.0]
    assert [x.output_bytes for x in p.layers] == [1024, 1024, 64]  # list activation_size summed
    assert [x.activation_bytes for x in p.layers] == [1024, 1024, 64]
    assert [x.parameter_bytes for x in p.layers] == [896, 0, 72]
    assert p.model_args["chain"] is True


def test_diamond_dag_cut_bytes() -> None:
    p = pipedream.convert(DIAMOND, model="diamond")
    assert [x.name.split(":")[0] for x in p.layers] == ["node2", "node3", "node4", "node5"]
    # after A: A's output once (read by B and C); after B: A (for C) + B (for D); after C: B + C; last: D's own.
    assert [x.output_bytes for x in p.layers] == [100, 130, 37, 2]
    assert [x.parameter_bytes for x in p.layers] == [10, 20, 30, 40]
    assert p.model_args["chain"] is False


def test_cli_writes_a_profile_the_planner_reads(tmp_path, capsys) -> None:
    g = tmp_path / "vggish" / "graph.txt"
    g.parent.mkdir()
    g.write_text(DIAMOND)
    out = tmp_path / "profile.json"
    assert pipedream.main([str(g), "-o", str(out), "--microbatch-size", "64"]) == 0
    assert "4 layers (DAG, linearised)" in capsys.readouterr().out
    prof = Profile.load(out)
    assert (prof.model, prof.microbatch_size, len(prof.layers)) == ("vggish", 64, 4)
    plan_out = tmp_path / "plan.json"
    assert plan_main([str(out), "--workers", "2", "--schedule", "async", "--microbatches", "2",
                      "-o", str(plan_out)]) == 0
    assert json.loads(plan_out.read_text())["workers"] == 2


@pytest.mark.parametrize("text, message", [
    ("node1 -- A -- forward_compute_time=1.0\n",
     "graph.txt:1: expected 'forward_compute_time=..., backward_compute_time=..., activation_size=..., "
     "parameter_size=...', found 'forward_compute_time=1.0'"),
    (_node(1, "A", 1, 1, "x", 0) + "\n", "graph.txt:1: activation_size must be a number, found 'x'"),
    (_node(1, "A", 1, 1, "1", 0) + "\n\tnode1 -- node9\n",
     "graph.txt: edge node1 -- node9 names node 'node9', which has no line"),
    (_node(1, "A", 1, 1, "1", 0) + "\n" + _node(2, "B", 1, 1, "1", 0) + "\n\tnode1 -- node2\n\tnode2 -- node1\n",
     "graph.txt: the graph has a cycle through node1, node2: expected a DAG"),
    ("", "graph.txt: no nodes: expected PipeDream's graph.txt (one line per node)"),
])
def test_bad_graph_one_line_exit_2(tmp_path, capsys, text: str, message: str) -> None:
    g = tmp_path / "graph.txt"
    g.write_text(text)
    assert pipedream.main([str(g), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"pipedream: error: {message}\n"
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("model, layers, chain", [("vgg16", 40, False), ("alexnet", 22, False),
                                                  ("gnmt", 37, False), ("gnmt_large", 77, False)])
def test_committed_pipedream_profiles_load(model: str, layers: int, chain: bool) -> None:
    """benchmarks/planner/pipedream/*/profile.json (converted from PipeDream's graph.txt) are valid profiles."""
    from pathlib import Path
    p = Profile.load(Path(__file__).parent.parent / "benchmarks" / "planner" / "pipedream" / model / "profile.json")
    assert (len(p.layers), p.model_args["chain"], p.model_args["source"]) == (layers, chain, "PipeDream graph.txt")
    assert all(x.output_bytes > 0 for x in p.layers[:-1])  # every cut carries something


def test_vgg16_15_1_on_two_levels() -> None:
    """PipeDream's VGG-16 finding (benchmarks/planner/pipedream.md): on 4 servers x 4 GPUs a stage replicated
    15 times (three servers and three GPUs of the fourth) is proposed, and priced with the fullest group's
    ring at each level."""
    from pathlib import Path

    from partitioner.price import level_factors
    from partitioner.service import plan_detailed
    from partitioner.topology import Topology

    topo = Topology.parse("4x10GB/s,4x1.25GB/s")
    assert level_factors(list(range(15)), topo) == [4, 4]
    assert level_factors([0, 1, 4, 5, 8, 9], topo) == [2, 3]
    prof = Profile.load(Path(__file__).resolve().parent.parent / "benchmarks/planner/pipedream/vgg16/profile.json")
    plan = plan_detailed(prof, 16, schedule="async", microbatches=30, topology=topo).plan
    assert [st.replicas for st in plan.stages] == [15, 1] and plan.stages[1].ranks == [15]
    assert plan.extra["planner"]["search"]["partial_groups"] is True
    assert plan.predicted["step_ms"] / 30 == pytest.approx(42.67, abs=0.01)
