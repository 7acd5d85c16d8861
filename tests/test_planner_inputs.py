"""Issue 11 and 13 inputs to `pipeflow-plan`: one line, exit 2, within seconds; schedule rules; --evaluate."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from partitioner.cli import main
from partitioner.plan import Plan, PlanError
from partitioner.profile import LayerProfile, Profile, ProfileError
from partitioner.service import MAX_MICROBATCHES, MAX_WORKERS


def make_profile(n: int = 8, **kw: Any) -> Profile:
    return Profile("mlp", {"layers": n}, "cpu", "float32", 4,
                   [LayerProfile(f"l{i}", 1.0 + (i % 3), 2.0 + 2 * (i % 3), 100_000, 1_000_000, 4_000_000)
                    for i in range(n)], **kw)


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    p = tmp_path / "profile.json"
    make_profile().save(p)
    return p


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeflow-plan: error: ") and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize("args,message", [
    (["--workers", "4", "--memory-per-worker", "1e400"],
     "--memory-per-worker must be a finite size such as 16GB, found '1e400'"),
    (["--workers", "4", "--topology", "4x1e400GB/s"],
     "--topology '4x1e400GB/s': bandwidth must be a finite rate such as 300GB/s, found '1e400GB/s'"),
    (["--workers", "10000"], f"--workers must be at most {MAX_WORKERS} (the planner's limit), found 10000"),
    (["--workers", "4", "--microbatches", "100000000"],
     f"--microbatches must be at most {MAX_MICROBATCHES} (the planner's limit), found 100000000"),
])
def test_sizes_refused_in_one_line(tmp_path: Path, profile_path: Path, capsys: pytest.CaptureFixture[str],
                                   args: list[str], message: str) -> None:
    t0 = time.perf_counter()
    err = one_line_error(capsys, [str(profile_path), *args, "-o", str(tmp_path / "plan.json")])
    assert err == f"pipeflow-plan: error: {message}"
    assert time.perf_counter() - t0 < 5
    assert not (tmp_path / "plan.json").exists()


def test_huge_profile_time_is_refused_not_misreported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_profile().to_json()
    d["layers"][3]["forward_ms"] = 1e308
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps(d))
    err = one_line_error(capsys, [str(bad), "--workers", "4", "-o", str(tmp_path / "plan.json")])
    assert err == ("pipeflow-plan: error: profile.json: layers[3].forward_ms must be at most 1e+09 (ms), "
                   "found 1e+308")


def test_largest_allowed_size_answers_quickly(tmp_path: Path, profile_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = main([str(profile_path), "--workers", str(MAX_WORKERS), "--microbatches", "8", "-o",
                 str(tmp_path / "plan.json")])
    assert code == 0, capsys.readouterr().err
    assert Plan.load(tmp_path / "plan.json").workers == MAX_WORKERS


def test_unknown_schedule_in_plan_json(tmp_path: Path, profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = {"format": "pipeflow.plan/1", "schedule": "zb-h3", "microbatches": 4, "workers": 1,
         "stages": [{"layers": [0, 8], "replicas": 1, "ranks": [0]}]}
    with pytest.raises(PlanError) as e:
        Plan.from_json(d, source="plan.json")
    assert str(e.value) == ("plan.json: plan.schedule must be one of gpipe, 1f1b, async, 2bw, interleaved, zb, zb-h2, "
                            "found 'zb-h3'")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(d))
    err = one_line_error(capsys, [str(profile_path), "--evaluate", str(path), "-o", str(tmp_path / "out.json")])
    assert err.endswith("plan.schedule must be one of gpipe, 1f1b, async, 2bw, interleaved, zb, zb-h2, found 'zb-h3'")


def test_async_where_the_dp_would_replicate_gets_a_valid_plan(tmp_path: Path) -> None:
    # Issue 13 item 6: light weights, big activations: the DP wants one stage on 3 replicas, which async
    # cannot run with m = 4 (3 does not divide 4). Today a ScheduleError traceback; now a plan that async can
    # run, or for an m no plan fits, one line.
    prof = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 2.0, 10**8, 1000, 1000)
                                                  for i in range(4)])
    src, out = tmp_path / "p.json", tmp_path / "plan.json"
    prof.save(src)
    assert main([str(src), "--workers", "3", "--topology", "3x1GB/s", "--schedule", "async", "--microbatches", "4",
                 "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert all(4 % r == 0 for r in plan.replicas) and sum(plan.replicas) == 3
    assert main([str(src), "--workers", "3", "--schedule", "async", "--microbatches", "auto", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert all(plan.microbatches % r == 0 for r in plan.replicas)


def test_2bw_needs_m_at_least_stages_minus_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Huge weights over a slow link: data parallelism is out, 4 straight stages it must be; 2bw needs m >= 3.
    prof = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 2.0, 0, 0, 10**12) for i in range(4)])
    src, out = tmp_path / "p.json", tmp_path / "plan.json"
    prof.save(src)
    assert main([str(src), "--workers", "4", "--topology", "4x1GB/s", "--schedule", "2bw", "--microbatches", "3",
                 "-o", str(out)]) == 0
    assert Plan.load(out).replicas == [1, 1, 1, 1]
    capsys.readouterr()
    assert main([str(src), "--workers", "4", "--topology", "4x1GB/s", "--schedule", "2bw", "--microbatches", "2",
                 "-o", str(out)]) == 0
    plan = Plan.load(out)  # a 3-stage plan (m >= S - 1 = 2) with one stage replicated twice
    assert len(plan.stages) <= 3 and max(plan.replicas) <= 2


def test_evaluate_prices_a_hand_written_plan(tmp_path: Path, profile_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # Plan with the CLI, then evaluate the written plan: same figures, same table.
    planned = tmp_path / "plan.json"
    assert main([str(profile_path), "--workers", "4", "--topology", "2x300GB/s,2x25GB/s", "--microbatches", "8",
                 "-o", str(planned)]) == 0
    table = capsys.readouterr().out.splitlines()[:-1]
    again = tmp_path / "again.json"
    assert main([str(profile_path), "--evaluate", str(planned), "--topology", "2x300GB/s,2x25GB/s",
                 "-o", str(again)]) == 0
    assert capsys.readouterr().out.splitlines()[:-1] == table
    assert Plan.load(again).predicted == Plan.load(planned).predicted
    # A hand-written split: written back with 'predicted' filled, slower than the planner's.
    d = {"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 8, "workers": 4,
         "stages": [{"layers": [0, 2], "replicas": 1, "ranks": [0]}, {"layers": [2, 4], "replicas": 1, "ranks": [1]},
                    {"layers": [4, 6], "replicas": 1, "ranks": [2]}, {"layers": [6, 8], "replicas": 1, "ranks": [3]}]}
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps(d))
    out = tmp_path / "hand_priced.json"
    assert main([str(profile_path), "--evaluate", str(hand), "--topology", "2x300GB/s,2x25GB/s", "-o", str(out)]) == 0
    priced = Plan.load(out)
    assert [s.layers for s in priced.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert priced.predicted["step_ms"] >= Plan.load(planned).predicted["step_ms"]
    assert "step" in capsys.readouterr().out
    # Flags that contradict the plan: one line.
    err = one_line_error(capsys, [str(profile_path), "--evaluate", str(hand), "--microbatches", "4",
                                  "-o", str(out)])
    assert err.endswith("--microbatches 4 differs from the plan's 8 (" + str(hand) + "); drop --microbatches to "
                        "evaluate the plan as written")


def test_layers_per_stage_prices_the_split_as_evaluate_does(tmp_path: Path, profile_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--layers-per-stage builds the straight plan pipeflow-train --layers-per-stage runs and prices it as
    --evaluate prices the same plan written by hand; 'even' with --workers splits as pipeflow-train does."""
    d = {"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 8, "workers": 4,
         "stages": [{"layers": [0, 3], "replicas": 1, "ranks": [0]}, {"layers": [3, 5], "replicas": 1, "ranks": [1]},
                    {"layers": [5, 7], "replicas": 1, "ranks": [2]}, {"layers": [7, 8], "replicas": 1, "ranks": [3]}]}
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps(d))
    topo = ["--topology", "2x300GB/s,2x25GB/s"]
    assert main([str(profile_path), "--evaluate", str(hand), *topo, "-o", str(tmp_path / "a.json")]) == 0
    table = capsys.readouterr().out.splitlines()[:-1]
    assert main([str(profile_path), "--layers-per-stage", "3,2,2,1", "--microbatches", "8", *topo,
                 "-o", str(tmp_path / "b.json")]) == 0
    assert capsys.readouterr().out.splitlines()[:-1] == table
    a, b = Plan.load(tmp_path / "a.json"), Plan.load(tmp_path / "b.json")
    assert b.predicted == a.predicted and [s.layers for s in b.stages] == [(0, 3), (3, 5), (5, 7), (7, 8)]
    assert main([str(profile_path), "--layers-per-stage", "even", "--workers", "4", "--microbatches", "8", *topo,
                 "-o", str(tmp_path / "c.json")]) == 0
    assert [s.layers for s in Plan.load(tmp_path / "c.json").stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_layers_per_stage_keeps_gemm_accumulation_where_the_profile_timed_it_faster(tmp_path: Path) -> None:
    prof = make_profile()
    for x in prof.layers:
        x.forward_gemm_ms, x.backward_gemm_ms, x.backward_accumulate_gemm_ms = x.forward_ms, x.backward_ms / 2, 1.0
    prof.save(tmp_path / "p.json")
    assert main([str(tmp_path / "p.json"), "--layers-per-stage", "4,4", "--microbatches", "4",
                 "-o", str(tmp_path / "o.json")]) == 0
    assert Plan.load(tmp_path / "o.json").accumulation == "gemm"


@pytest.mark.parametrize("args,message", [
    (["--layers-per-stage", "4,4"], "--layers-per-stage prices one plan: give --microbatches M"),
    (["--layers-per-stage", "4,4", "--microbatches", "auto"],
     "--layers-per-stage prices one plan: give --microbatches M"),
    (["--layers-per-stage", "3,3", "--microbatches", "4"],
     "layer counts [3, 3] must be 2 positive numbers summing to 8"),
    (["--layers-per-stage", "4,x", "--microbatches", "4"],
     "--layers-per-stage must be comma-separated integers or 'even', found '4,x'"),
    (["--layers-per-stage", "4,4", "--workers", "3", "--microbatches", "4"],
     "--layers-per-stage gives 2 stages but --workers 3 makes 3"),
    (["--layers-per-stage", "even", "--microbatches", "4"], "--layers-per-stage even needs --workers"),
    (["--layers-per-stage", "4,4", "--microbatches", "4", "--memory-per-worker", "1GB"],
     "--global-batch, --memory-per-worker and --straight shape a search; --layers-per-stage prices the split as given"),
    (["--layers-per-stage", "4,4", "--microbatches", "4", "--evaluate", "x.json"],
     "give one of --evaluate PLAN and --layers-per-stage COUNTS"),
    (["--layers-per-stage", "2,2,2", "--microbatches", "4", "--schedule", "interleaved"],
     "--layers-per-stage gives 3 stages, not a multiple of --virtual-stages 2"),
])
def test_layers_per_stage_refuses_bad_input_in_one_line(tmp_path: Path, profile_path: Path, args: list[str],
                                                        message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(capsys, [str(profile_path), *args, "-o", str(tmp_path / "o.json")])
    assert err == "pipeflow-plan: error: " + message


def test_evaluate_refuses_a_plan_the_schedule_cannot_run(tmp_path: Path, profile_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    d = {"format": "pipeflow.plan/1", "schedule": "async", "microbatches": 4, "workers": 3,
         "stages": [{"layers": [0, 8], "replicas": 3, "ranks": [0, 1, 2]}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    err = one_line_error(capsys, [str(profile_path), "--evaluate", str(path), "-o", str(tmp_path / "o.json")])
    assert err == ("pipeflow-plan: error: the plan cannot run: async needs every stage's replica count to divide "
                   "the microbatches per step, found replicas [3] and --microbatches 4")


def test_optional_profile_fields_round_trip_and_count(tmp_path: Path) -> None:
    old = make_profile()
    assert "loss_ms" not in old.to_json() and "backward_accumulate_ms" not in old.to_json()["layers"][0]
    new = make_profile(loss_ms=5.0, optimizer_ms_per_byte={"adam": 1e-6})
    for layer in new.layers:
        layer.backward_accumulate_ms = layer.backward_ms + 1.0
    path = tmp_path / "p.json"
    new.save(path)
    assert Profile.load(path) == new
    d = json.loads(path.read_text())
    assert d["format"] == "pipeflow.profile/1" and d["loss_ms"] == 5.0
    # Priced: one stage on one worker, m = 2 under 1f1b: 2 x (forward + accumulating backward) + loss x 2
    # + one adam step over 32 MB at 1e-6 ms per byte.
    plan_old, plan_new = tmp_path / "a.json", tmp_path / "b.json"
    old.save(tmp_path / "old.json")
    assert main([str(tmp_path / "old.json"), "--workers", "1", "--microbatches", "2", "-o", str(plan_old)]) == 0
    assert main([str(path), "--workers", "1", "--microbatches", "2", "-o", str(plan_new)]) == 0
    a, b = Plan.load(plan_old).predicted["step_ms"], Plan.load(plan_new).predicted["step_ms"]
    assert b - a == pytest.approx(2 * 8 * 1.0 + 2 * 5.0 + 32e6 * 1e-6)
    d["loss_ms"] = -1
    with pytest.raises(ProfileError, match=r"loss_ms must be a number in \[0, 1e\+09\], found -1"):
        Profile.from_json(d)


@pytest.mark.parametrize("how", [[], ["--evaluate", "PLAN"], ["--layers-per-stage", "even"]],
                         ids=["plan", "evaluate", "layers-per-stage"])
def test_an_optimizer_the_profile_did_not_time_is_refused_before_planning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], how: list[str]) -> None:
    """Priced at 0 it made adam look cheaper than the sgd the profile timed; a profile without the field (older ones)
    still plans with any --optimizer, its updates at 0."""
    sgd, old, out = tmp_path / "sgd.json", tmp_path / "old.json", tmp_path / "plan.json"
    make_profile(optimizer_ms_per_byte={"sgd": 1e-6}).save(sgd)
    make_profile().save(old)
    written = tmp_path / "written.json"
    assert main([str(old), "--workers", "2", "--microbatches", "4", "-o", str(written)]) == 0
    args = [a.replace("PLAN", str(written)) for a in how] + ["--workers", "2", "--microbatches", "4", "-o", str(out)]
    assert one_line_error(capsys, [str(sgd), *args]) == (
        f"pipeflow-plan: error: --optimizer adam: {sgd} timed the update of sgd only (optimizer_ms_per_byte), so "
        "adam's updates would be priced at 0; plan with --optimizer sgd, or profile again with pipeflow-profile "
        "--optimizer adam")
    assert not out.exists()
    assert main([str(sgd), *args, "--optimizer", "sgd"]) == 0
    assert main([str(old), *args, "--optimizer", "adamw"]) == 0
