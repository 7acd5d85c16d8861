"""Parameters shared by layers (a tied embedding and head, a block repeated in the layer list): the profile records
them (`ties`), the planner counts a shared parameter once per stage holding it, prices the sum of its copies'
gradients at the STEP, and under async and 2bw never splits one over stages (the runtime refuses such a plan)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner import cli
from partitioner.plan import Plan, StagePlan
from partitioner.profile import LayerProfile, Profile, ProfileError
from partitioner.profiler import profile_model
from partitioner.service import evaluate_plan, plan_detailed
from pipeflow.planning import check_model_on_plan
from tests.models import shared_mlp

D_IN, HIDDEN = 6, 8
INPUT, BLOCK = (D_IN * HIDDEN + HIDDEN) * 4, (HIDDEN * HIDDEN + HIDDEN) * 4  # float32 bytes; the head holds INPUT


def synthetic(ties: list[dict[str, object]] | None, layers: int = 6) -> Profile:
    """Equal layers (so the untied optimum of 3 straight stages cuts at 2 and 4), with `ties`."""
    return Profile("m", {}, "cpu", "float32", 4,
                   [LayerProfile(f"l{i}", 1.0, 2.0, 1000, 10_000, BLOCK) for i in range(layers)], ties=ties)


def unique_bytes(spec_layers: list[object], a: int, b: int) -> int:
    """What a stage of layers [a, b) holds: every parameter once."""
    seen = {id(p): p for layer in spec_layers[a:b] for p in layer.parameters()}  # type: ignore[attr-defined]
    return sum(p.numel() * p.element_size() for p in seen.values())


def test_the_profile_records_which_layers_share_parameters(tmp_path: Path) -> None:
    prof = profile_model(shared_mlp(), 4, repeats=1, warmup=0)
    assert prof.ties == [{"layers": [0, 5], "bytes": INPUT}, {"layers": [1, 2, 3], "bytes": BLOCK}]
    assert [x.parameter_bytes for x in prof.layers] == [INPUT, BLOCK, BLOCK, BLOCK, BLOCK, INPUT]
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").ties == prof.ties
    assert profile_model(shared_mlp(repeats=1, tie_head=False), 4, repeats=1, warmup=0).ties is None
    # in the dtype the layers are profiled in (--dtype), as their parameter_bytes are
    half = profile_model(shared_mlp(), 4, repeats=1, warmup=0, dtype="bfloat16")
    assert half.ties == [{"layers": [0, 5], "bytes": INPUT // 2}, {"layers": [1, 2, 3], "bytes": BLOCK // 2}]


def test_a_stage_holds_a_shared_parameter_once() -> None:
    spec = shared_mlp()
    prof = profile_model(spec, 4, repeats=1, warmup=0)
    one = plan_detailed(prof, 1, schedule="1f1b", microbatches=4)
    assert one.costs[0].parameter_bytes == unique_bytes(spec.layers, 0, 6) == INPUT + 2 * BLOCK
    for ranges in ([(0, 2), (2, 6)], [(0, 3), (3, 6)], [(0, 1), (1, 4), (4, 6)]):
        plan = Plan("1f1b", 4, len(ranges), [StagePlan(r, 1, [k]) for k, r in enumerate(ranges)])
        costs = evaluate_plan(prof, plan).costs
        assert [c.parameter_bytes for c in costs] == [unique_bytes(spec.layers, a, b) for a, b in ranges]


def test_the_copies_gradient_sum_is_priced_at_the_step() -> None:
    ranges = [(0, 3), (3, 6)]
    plan = Plan("1f1b", 4, 2, [StagePlan(r, 1, [k]) for k, r in enumerate(ranges)])
    alone = evaluate_plan(synthetic(None), plan, topology="2x1MB/s").costs
    tied = evaluate_plan(synthetic([{"layers": [0, 5], "bytes": 200}]), plan, topology="2x1MB/s").costs
    # a ring of 2 ranks: 2 (2 - 1) / 2 x 200 B at 1 MB/s = 0.2 ms on each of the two stages holding a copy
    assert [b.optimizer_ms - a.optimizer_ms for a, b in zip(alone, tied)] == pytest.approx([0.2, 0.2])
    assert tied[0].parameter_bytes == alone[0].parameter_bytes  # a copy on each stage, each counted


@pytest.mark.parametrize("schedule", ["async", "2bw"])
def test_async_and_2bw_plans_keep_the_layers_of_a_tie_on_one_stage(schedule: str) -> None:
    ties = [{"layers": [1, 2, 3], "bytes": BLOCK}]
    untied = plan_detailed(synthetic(None), 3, schedule=schedule, microbatches=6, straight=True).plan
    assert [st.layers for st in untied.stages] == [(0, 2), (2, 4), (4, 6)]  # cuts inside layers 1-3
    plan = plan_detailed(synthetic(ties), 3, schedule=schedule, microbatches=6, straight=True).plan
    assert not {st.layers[0] for st in plan.stages} & {2, 3}, plan.stages
    check_model_on_plan(shared_mlp(tie_head=False), plan, "cpu")  # the runtime's own check: it runs
    with pytest.raises(Exception, match="shared by stages"):
        check_model_on_plan(shared_mlp(tie_head=False), untied, "cpu")
    # the flush schedules sum a tie's copies: they may split it
    flushed = plan_detailed(synthetic(ties), 3, schedule="1f1b", microbatches=6, straight=True).plan
    assert [st.layers for st in flushed.stages] == [(0, 2), (2, 4), (4, 6)]


def test_no_async_plan_when_every_cut_splits_a_tie(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synthetic([{"layers": [0, 5], "bytes": INPUT}]).save(tmp_path / "p.json")
    out = str(tmp_path / "plan.json")
    assert cli.main([str(tmp_path / "p.json"), "--workers", "2", "--straight", "--schedule", "async",
                     "--microbatches", "2", "-o", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layers 0, 5 (sharing parameters) on one stage" in err, err
    # without --straight: both workers replicate the whole model
    assert cli.main([str(tmp_path / "p.json"), "--workers", "2", "--schedule", "async", "--microbatches", "2",
                     "-o", out]) == 0
    assert [(st.layers, st.replicas) for st in Plan.load(out).stages] == [((0, 6), 2)]


def test_evaluate_refuses_an_async_plan_that_splits_a_tie(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synthetic([{"layers": [0, 5], "bytes": INPUT}]).save(tmp_path / "p.json")
    Plan("async", 2, 2, [StagePlan((0, 3), 1, [0]), StagePlan((3, 6), 1, [1])]).save(tmp_path / "plan.json")
    assert cli.main([str(tmp_path / "p.json"), "--evaluate", str(tmp_path / "plan.json"), "-o",
                     str(tmp_path / "out.json")]) == 2
    assert capsys.readouterr().err == (
        "pipeflow-plan: error: the plan cannot run: layers 0, 5 share parameters and the plan puts them on stages "
        "0, 1, which --schedule async cannot train (its stages would use different weight versions of one "
        "parameter): keep those layers on one stage, or use --schedule gpipe or 1f1b\n")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("ties, why", [
    ({"layers": [0, 5]}, "ties must be a list, found dict"),
    ([{"layers": [0, 5]}], "ties[0] must be an object with exactly the keys layers and bytes"),
    ([{"layers": [5, 0], "bytes": 1}], "ties[0].layers must be at least two increasing layer indices in [0, 6), "
                                        "found [5, 0]"),
    ([{"layers": [0, 6], "bytes": 1}], "ties[0].layers must be at least two increasing layer indices in [0, 6)"),
    ([{"layers": [0, 5], "bytes": -1}], "ties[0].bytes must be a number of bytes in [0, 1.15292e+18], found -1"),
    ([{"layers": [0, 5], "bytes": BLOCK + 1}], f"ties[0].bytes ({BLOCK + 1}) must be at most the parameter_bytes of "
                                               f"each of its layers, found layer 0's {BLOCK}"),
])
def test_bad_ties_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], ties: object,
                                          why: str) -> None:
    d = synthetic(None).to_json()
    (tmp_path / "p.json").write_text(json.dumps({**d, "ties": ties}))
    with pytest.raises(ProfileError, match=None) as e:
        Profile.load(tmp_path / "p.json")
    assert str(e.value).startswith(f"p.json: {why}"), str(e.value)
    assert cli.main([str(tmp_path / "p.json"), "--workers", "2", "-o", str(tmp_path / "o.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_every_microbatch_size_of_a_profile_has_its_ties(tmp_path: Path) -> None:
    ties = [{"layers": [1, 2, 3], "bytes": BLOCK}]
    top = synthetic(ties)
    top.others = [Profile("m", {}, "cpu", "float32", 8, [LayerProfile(f"l{i}", 2.0, 4.0, 2000, 20_000, BLOCK)
                                                         for i in range(6)])]
    top.save(tmp_path / "p.json")
    d = json.loads((tmp_path / "p.json").read_text())
    assert "ties" not in d["other_microbatch_sizes"][0]
    assert [p.ties for p in Profile.load(tmp_path / "p.json").at_sizes()] == [ties, ties]


def test_chunks_on_one_rank_hold_one_copy() -> None:
    """Interleaved: a parameter shared by two chunks of rank 0 is one Parameter there (pipeflow/links.py)."""
    ranges, ranks = [(0, 1), (1, 2), (2, 3), (3, 4)], [[0], [1], [0], [1]]
    plan = Plan("interleaved", 4, 2, [StagePlan(r, 1, k) for r, k in zip(ranges, ranks)])
    tied = evaluate_plan(synthetic([{"layers": [0, 2], "bytes": BLOCK}], layers=4), plan)
    alone = evaluate_plan(synthetic(None, layers=4), plan)
    assert [c.parameter_bytes for c in tied.costs] == [BLOCK, BLOCK, 0, BLOCK]
    # rank 0 holds one parameter less than without the tie: its weights, gradient and Adam's two states
    assert alone.sim.peak_memory_bytes[0] - tied.sim.peak_memory_bytes[0] == 4 * BLOCK
    assert tied.sim.peak_memory_bytes[1] == alone.sim.peak_memory_bytes[1]
