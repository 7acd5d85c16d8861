"""1f1b's (and 2bw's) warm-up depth as a planning decision: pipeflow-plan deepens it where its simulation gains
and memory allows, writes it in plan.json (`warmup`), --evaluate prices it, and the runtime runs it unless --warmup
says otherwise. On 2 H200s one extra warm-up forward on stage 0 ran 1f1b 4.4% faster at 8 x 8 (benchmarks/gpu)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from partitioner.cli import main
from partitioner.plan import Plan, PlanError
from partitioner.profile import LayerProfile, Profile
from pipeflow.api import Pipeline
from pipeflow.planning import resolve_warmup
from pipeflow.schedule import Kind
from tests import api_user_loop


def two_stage_profile(device: str = "cuda") -> Profile:
    """Stage 0 F 2 / B 2 ms, stage 1 F 2 / B 1 ms (a last stage with a light backward), 1 MB of activations
    each. Under DAPPLE's minimum stage 0 waits for every gradient: F(i+2) is done long before B(i+1) arrives."""
    return Profile("m", {}, device, "bfloat16", 1, [LayerProfile("a", 2.0, 2.0, 1000, 10**6, 1000),
                                                    LayerProfile("b", 2.0, 1.0, 1000, 10**6, 1000)])


def plan_cli(tmp_path: Path, *flags: str, device: str = "cuda") -> dict:
    src, out = tmp_path / "profile.json", tmp_path / "plan.json"
    two_stage_profile(device).save(src)
    assert main([str(src), "--workers", "2", "--topology", "2x1GB/s", "--schedule", "1f1b", "--microbatches", "4",
                 *flags, "-o", str(out)]) == 0
    return json.loads(out.read_text())


def test_the_planner_deepens_the_warm_up_where_the_simulation_gains(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_cli(tmp_path, "--straight")
    assert plan["warmup"] == [2, 0]
    assert plan["predicted"]["step_ms"] == pytest.approx(16.002)  # stage 0 never idles: 4 x (2 + 2) ms
    assert plan["predicted"]["peak_memory_bytes"][0] == 3 * 10**6 + 4000  # three microbatches in flight
    assert "warm-up: 2, 0 forwards before the first backward per stage (the schedule's minimum: 1, 0;" in \
        capsys.readouterr().out
    # Not where the memory does not allow it: two in flight fit 2.5 MB, three do not.
    plan = plan_cli(tmp_path, "--straight", "--memory-per-worker", "2.5MB")
    assert "warmup" not in plan
    assert plan["predicted"]["step_ms"] == pytest.approx(18.004)
    # Not on CPU, where ranks sharing cores send with their own CPU time (no gain measured on the CI machine).
    plan = plan_cli(tmp_path, "--straight", device="cpu")
    assert "warmup" not in plan
    assert plan["predicted"]["step_ms"] == pytest.approx(18.004)


def test_2bw_runs_and_prices_a_given_warm_up_but_the_planner_keeps_its_own(tmp_path: Path) -> None:
    """2bw never flushes, but with one forward of slack a stage's steady state still waits a round trip per
    microbatch in the simulation: 1 MB messages at 1 GB/s (1 ms) take 2 balanced stages of 4 ms per microbatch
    to 5 ms, and one more warm-up forward on stage 0 hides it (4 x 4 ms), for one more microbatch of
    activations there (3 in flight) beside two weight copies (the older version and the next minibatch's,
    stash.py). --evaluate prices a plan naming it; pipeflow-plan does not choose it: on 2 H200s it gained
    nothing measurable (benchmarks/gpu/README.md)."""
    src, out = tmp_path / "profile.json", tmp_path / "plan.json"
    Profile("m", {}, "cuda", "bfloat16", 1, [LayerProfile("a", 2.0, 2.0, 10**6, 10**6, 1000),
                                             LayerProfile("b", 2.0, 2.0, 10**6, 10**6, 1000)]).save(src)
    assert main([str(src), "--workers", "2", "--topology", "2x1GB/s", "--schedule", "2bw", "--microbatches", "4",
                 "--straight", "-o", str(out)]) == 0
    got = json.loads(out.read_text())
    assert "warmup" not in got
    assert got["predicted"]["step_ms"] == pytest.approx(20.0)
    assert got["predicted"]["peak_memory_bytes"] == [2 * 10**6 + 6 * 1000, 10**6 + 5 * 1000]
    got["warmup"] = [2, 0]
    (tmp_path / "given.json").write_text(json.dumps(got))
    assert main([str(src), "--evaluate", str(tmp_path / "given.json"), "--topology", "2x1GB/s", "-o", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["warmup"] == [2, 0]
    assert got["predicted"]["step_ms"] == pytest.approx(16.0)
    assert got["predicted"]["peak_memory_bytes"] == [3 * 10**6 + 6 * 1000, 10**6 + 5 * 1000]


def test_evaluate_prices_the_warm_up_the_plan_names(tmp_path: Path) -> None:
    src, given, out = tmp_path / "profile.json", tmp_path / "given.json", tmp_path / "out.json"
    two_stage_profile().save(src)
    stages = [{"layers": [0, 1], "replicas": 1, "ranks": [0]}, {"layers": [1, 2], "replicas": 1, "ranks": [1]}]
    for warmup, want in ((None, 18.004), ([2, 0], 16.002)):
        body = {"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 4, "workers": 2, "stages": stages}
        given.write_text(json.dumps(body if warmup is None else {**body, "warmup": warmup}))
        assert main([str(src), "--evaluate", str(given), "--topology", "2x1GB/s", "-o", str(out)]) == 0
        got = json.loads(out.read_text())
        assert got.get("warmup") == warmup and got["predicted"]["step_ms"] == pytest.approx(want)


def test_a_plans_warm_up_is_checked_and_goes_with_its_schedule() -> None:
    stages = [{"layers": [0, 1], "replicas": 1, "ranks": [0]}, {"layers": [1, 2], "replicas": 1, "ranks": [1]}]
    body = {"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 4, "workers": 2, "stages": stages}
    with pytest.raises(PlanError, match=r"^plan: plan.warmup must be 2 non-negative integers \(forwards before the "
                                        r"first backward, one per stage\), found \[2\]$"):
        Plan.from_json({**body, "warmup": [2]})
    with pytest.raises(PlanError, match=r"^plan: plan.warmup applies to schedule 1f1b and 2bw only, found 'gpipe'$"):
        Plan.from_json({**body, "schedule": "gpipe", "warmup": [2, 0]})
    plan = Plan.from_json({**body, "warmup": [2, 0]})
    assert plan.warmup == [2, 0] and plan.to_json()["warmup"] == [2, 0]
    assert resolve_warmup("plan", plan) is None  # the engine takes the plan's
    assert resolve_warmup("min", plan) == [1, 0]  # DAPPLE's minimum, over the plan's
    assert resolve_warmup("3,0", plan) == [3, 0]
    plan.set_schedule("1f1b")  # the same schedule: the planner's warm-up stays
    assert plan.warmup == [2, 0]
    plan.set_schedule("2bw")  # --schedule 2bw over a 1f1b plan: a depth planned for 1f1b's flush does not go with it
    assert plan.warmup is None and "warmup" not in plan.to_json()
    plan = Plan.from_json({**body, "warmup": [2, 0]})
    plan.set_schedule("gpipe")  # --schedule gpipe over a 1f1b plan: no warm-up to run
    assert plan.warmup is None and "warmup" not in plan.to_json()


def compute_order(pipe: Pipeline) -> list[str]:
    return [f"{a.kind.name}{a.microbatch}" for a in pipe.engine.actions if a.kind in (Kind.F, Kind.B)]


def test_the_runtime_runs_the_plans_warm_up_and_trains_the_same() -> None:
    """One process, one stage: the plan's warm-up of 1 runs both forwards first (the minimum is 0); the
    weights equal single-process training either way."""
    want, _ = api_user_loop.reference()
    plan = Plan.from_json({"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 2, "workers": 1,
                           "stages": [{"layers": [0, 4], "replicas": 1, "ranks": [0]}], "warmup": [1]})
    for warmup, order in ((None, ["F0", "F1", "B0", "B1"]), ([0], ["F0", "B0", "F1", "B1"])):
        with Pipeline(api_user_loop.model(), F.cross_entropy, plan=plan, device="cpu", warmup=warmup,
                      optimizer=lambda p: torch.optim.SGD(p, lr=api_user_loop.LR)) as pipe:
            assert compute_order(pipe) == order
            for x, y in api_user_loop.batches():
                pipe.step(x, target=y)
            got = pipe.state_dict()
        assert got is not None
        for k in want:
            torch.testing.assert_close(got[k], want[k])


def test_the_warm_up_that_will_run_is_checked_before_any_process_group() -> None:
    """make_plan checks the schedule's rule with --warmup's counts, else the plan's: 2bw at m = 3 cannot warm up
    with 4 forwards (the share of a minibatch it needs), but can with 3."""
    from pipeflow.failure import UsageError
    from pipeflow.planning import make_plan
    from pipeflow.spec import build_model
    from pipeflow.train import build_parser

    spec = build_model("mlp", {"layers": 6})
    flags = ["--model", "mlp", "--schedule", "2bw", "--microbatches", "3", "--layers-per-stage", "3,3"]
    with pytest.raises(UsageError) as e:
        make_plan(build_parser().parse_args([*flags, "--warmup", "4,0"]), spec, 2, 0, None)
    assert str(e.value) == ("2bw needs every replica's share of a minibatch (--microbatches // replicas) to cover its "
                            "warm-up forwards (two weight versions), found stage 0 with 1 replica(s) and 4 warm-up "
                            "forward(s) at 3 microbatches")
    assert make_plan(build_parser().parse_args([*flags, "--warmup", "3,0"]), spec, 2, 0, None).schedule == "2bw"
