"""Gradient accumulation as a planning decision (partitioner/accumulation.py): pipeflow-profile times the chain with
autograd's accumulation and inside the weight GEMMs, pipeflow-plan keeps the faster and says so in plan.json,
--evaluate prices the plan's, and pipeflow-train runs it (tests/test_accumulate.py, under mpirun)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from partitioner.accumulation import gemm_variant
from partitioner.cli import main
from partitioner.plan import Plan, PlanError
from partitioner.profile import LayerProfile, Profile
from partitioner.profiler import profile_model
from pipeflow.spec import build_model

GPT = {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256}


def layer(name: str, gemm_backward: float) -> LayerProfile:
    """2 ms forward, 4 ms backward (5 accumulating) with autograd; with gemm the forward costs 2.5 ms (the Python
    Function's host time) and the accumulating backward `gemm_backward`."""
    return LayerProfile(name, 2.0, 4.0, 1000, 10**6, 10**6, backward_accumulate_ms=5.0, forward_gemm_ms=2.5,
                        backward_gemm_ms=4.0, backward_accumulate_gemm_ms=gemm_backward)


def plan_cli(tmp_path: Path, gemm_backward: float, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    src, out = tmp_path / "profile.json", tmp_path / "plan.json"
    Profile("m", {}, "cuda", "bfloat16", 1, [layer("a", gemm_backward), layer("b", gemm_backward)]).save(src)
    capsys.readouterr()
    assert main([str(src), "--workers", "2", "--topology", "2x100GB/s", "--schedule", "1f1b", "--microbatches", "8",
                 "--straight", "-o", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_the_planner_keeps_the_faster_accumulation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # gemm's accumulating backward 3.5 ms against 5: 2.5 + 3.5 = 6 ms a microbatch against 7, so gemm wins
    plan, out = plan_cli(tmp_path, 3.5, capsys)
    assert plan["accumulation"] == "gemm"
    assert "accumulation: gemm (each nn.Linear adds its weight gradient inside the GEMM, priced with the " in out
    gemm_ms = plan["predicted"]["step_ms"]
    # 4.8 ms: 2.5 + 4.8 = 7.3 against 7, so autograd's plan stays, with nothing written
    plan, out = plan_cli(tmp_path, 4.8, capsys)
    assert "accumulation" not in plan and "accumulation:" not in out
    assert plan["predicted"]["step_ms"] > gemm_ms
    # --evaluate prices a plan by the accumulation it names
    given = tmp_path / "given.json"
    for accumulation, want in (("gemm", None), (None, plan["predicted"]["step_ms"])):
        body = {k: v for k, v in plan.items() if k not in ("predicted", "planner", "accumulation")}
        if accumulation:
            body["accumulation"] = accumulation
        given.write_text(json.dumps(body))
        assert main([str(tmp_path / "profile.json"), "--evaluate", str(given), "--topology", "2x100GB/s", "-o",
                     str(tmp_path / "out.json")]) == 0
        got = json.loads((tmp_path / "out.json").read_text())
        assert got.get("accumulation") == accumulation
        if want is None:  # gemm's times at 4.8 ms: slower than autograd's plan
            assert got["predicted"]["step_ms"] > plan["predicted"]["step_ms"]
        else:
            assert got["predicted"]["step_ms"] == pytest.approx(want)


def test_evaluating_a_gemm_plan_on_a_profile_without_gemm_times_says_so(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    src, given = tmp_path / "profile.json", tmp_path / "given.json"
    Profile("m", {}, "cuda", "bfloat16", 1, [LayerProfile("a", 2.0, 4.0, 1000, 10**6, 10**6)]).save(src)
    given.write_text(json.dumps({"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 2, "workers": 1,
                                 "accumulation": "gemm", "stages": [{"layers": [0, 1], "replicas": 1, "ranks": [0]}]}))
    assert main([str(src), "--evaluate", str(given), "-o", str(tmp_path / "out.json")]) == 0
    assert capsys.readouterr().err.strip() == (
        f"pipeflow-plan: warning: {given} accumulates in the GEMMs but the profile has no gemm times (*_gemm_ms): "
        "priced with its own, right if it was profiled under PIPEFLOW_GRAD_ACCUM=gemm")


def test_a_profile_without_gemm_times_plans_as_before() -> None:
    prof = Profile("m", {}, "cuda", "bfloat16", 1, [LayerProfile("a", 2.0, 4.0, 1000, 10**6, 10**6)])
    assert gemm_variant(prof) is None
    half = Profile("m", {}, "cuda", "bfloat16", 1, [layer("a", 3.0), LayerProfile("b", 2.0, 4.0, 1000, 10**6, 10**6)])
    assert gemm_variant(half) is None  # every layer must have them
    both = gemm_variant(Profile("m", {}, "cuda", "bfloat16", 1, [layer("a", 3.0)]))
    assert both is not None and both.layers[0].forward_ms == 2.5 and both.layers[0].backward_accumulate_ms == 3.0


def test_the_profiler_times_the_chain_both_ways_and_the_file_keeps_them(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPEFLOW_GRAD_ACCUM", raising=False)
    spec = build_model("gpt", GPT)
    prof = profile_model(spec, 2, "cpu", warmup=0, repeats=1, timing="stage", gemm=True)
    assert all(x.forward_gemm_ms is not None and x.backward_gemm_ms is not None
               and x.backward_accumulate_gemm_ms is not None for x in prof.layers)
    prof.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert [x.backward_accumulate_gemm_ms for x in back.layers] == [x.backward_accumulate_gemm_ms for x in prof.layers]
    # with PIPEFLOW_GRAD_ACCUM set the ranks accumulate its way: the chain is timed that way only
    monkeypatch.setenv("PIPEFLOW_GRAD_ACCUM", "autograd")
    knob = profile_model(build_model("gpt", GPT), 2, "cpu", warmup=0, repeats=1, timing="stage", gemm=True)
    assert all(x.forward_gemm_ms is None for x in knob.layers)
    monkeypatch.delenv("PIPEFLOW_GRAD_ACCUM")
    # a model without an nn.Linear: gemm would change nothing, so nothing is timed twice
    mlp = profile_model(build_model("mlp", {"layers": 2}), 2, "cpu", warmup=0, repeats=1, timing="stage", gemm=True)
    assert any(x.forward_gemm_ms is not None for x in mlp.layers)  # the mlp has Linears: timed
    from pipeflow.spec import ModelSpec
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, 8), torch.randn(8, 4, 6))
    conv = ModelSpec([torch.nn.Conv1d(3, 4, 3)], torch.nn.functional.mse_loss, data)
    assert all(x.forward_gemm_ms is None
               for x in profile_model(conv, 2, "cpu", warmup=0, repeats=1, timing="stage", gemm=True).layers)
    # on CPU by default the chain is timed once (gemm: None means CUDA only)
    plain = profile_model(build_model("gpt", GPT), 2, "cpu", warmup=0, repeats=1, timing="stage")
    assert all(x.forward_gemm_ms is None for x in plain.layers)
    assert "forward_gemm_ms" not in json.dumps(plain.to_json())


def test_a_plan_names_a_known_accumulation() -> None:
    body = {"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 2, "workers": 1,
            "stages": [{"layers": [0, 2], "replicas": 1, "ranks": [0]}], "accumulation": "fused"}
    with pytest.raises(PlanError, match=r"^plan: plan.accumulation must be one of autograd, gemm, found 'fused'$"):
        Plan.from_json(body)
    body["accumulation"] = "gemm"
    assert Plan.from_json(body).accumulation == "gemm"
