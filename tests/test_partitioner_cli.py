"""`pipeflow-plan` end to end: table, plan.json, timeline, and one-line errors with exit code 2."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from partitioner.cli import main
from partitioner.plan import Plan
from partitioner.planner import PlanningError
from partitioner.profile import LayerProfile, Profile
from partitioner.service import AUTO_BUBBLE, plan_from_profile
from partitioner.topology import TopologyError
from tests.conftest import base_env, in_background


def make_profile(n: int = 8, *, params: int = 4_000_000, act: int = 1_000_000, out: int = 100_000) -> Profile:
    return Profile("mlp", {"layers": n}, "cpu", "float32", 4,
                   [LayerProfile(f"l{i}", 1.0 + (i % 3), 2.0 + 2 * (i % 3), out, act, params) for i in range(n)])


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    p = tmp_path / "profile.json"
    make_profile().save(p)
    return p


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "partitioner.cli", *args], capture_output=True, text=True,
                          timeout=120, env=base_env())


@in_background
def test_end_to_end_with_timeline(tmp_path: Path) -> None:
    """The console script in a process of its own (python, torch, matplotlib), run in the background."""
    profile_path = tmp_path / "profile.json"
    make_profile().save(profile_path)
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    r = run_cli(str(profile_path), "--workers", "4", "--topology", "2x300GB/s,2x25GB/s", "--schedule", "1f1b",
                "--microbatches", "8", "-o", str(out), "--timeline", str(png))
    assert r.returncode == 0, r.stderr
    plan = Plan.load(out)
    plan.validate(num_layers=8, world_size=4)
    assert plan.schedule == "1f1b" and plan.microbatches == 8 and plan.workers == 4
    pred = plan.predicted
    assert pred["step_ms"] > 0 and 0 <= pred["bubble_fraction"] < 1
    assert pred["samples_per_s"] == pytest.approx(8 * 4 / (pred["step_ms"] / 1e3), rel=1e-3)
    assert len(pred["peak_memory_bytes"]) == len(plan.stages)
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["stage", "layers", "replicas", "ranks", "compute", "ms", "comm", "ms", "memory"]
    assert len(lines) == 1 + len(plan.stages) + 2
    assert "samples/s" in lines[-2]
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_subprocess(tmp_path: Path, profile_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """pipeflow-plan's main in this process (the console script end to end: test_end_to_end_with_timeline)."""
    code = main([str(profile_path), "--workers", "5", "--topology", "2x300GB/s,2x25GB/s", "-o",
                 str(tmp_path / "plan.json")])
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "pipeflow-plan: error: --workers 5 does not match --topology '2x300GB/s,2x25GB/s', which has 2x2 = 4 workers"]
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("args,message", [
    (["--workers", "3", "--topology", "2x1GB/s"], "--workers 3 does not match --topology '2x1GB/s'"),
    (["--workers", "4", "--topology", "4xfast"], "bandwidth must look like 300GB/s"),
    (["--workers", "4", "--memory-per-worker", "much"], "--memory-per-worker must be a size such as 16GB"),
    (["--workers", "4", "--microbatches", "0"], "--microbatches must be a positive integer or 'auto', found '0'"),
    (["--workers", "4", "--microbatches", "many"], "--microbatches must be a positive integer or 'auto'"),
    (["--workers", "0"], "--workers must be a positive integer, found 0"),
    (["--workers", "9", "--straight"], "cannot place 9 workers on 8 layers with --straight"),
    (["--workers", "2", "--memory-per-worker", "1MB", "--microbatches", "4"],
     "no plan fits --memory-per-worker 976.56 KiB: even the fastest plan's stage"),
])
def test_bad_inputs(tmp_path: Path, profile_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                    message: str) -> None:
    assert main([str(profile_path), *args, "-o", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeflow-plan: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_bad_profile_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "profile.json"
    d: dict[str, Any] = make_profile().to_json()
    d["layers"][3]["forward_ms"] = -1
    bad.write_text(json.dumps(d))
    assert main([str(bad), "--workers", "2", "-o", str(tmp_path / "plan.json")]) == 2
    assert capsys.readouterr().err.strip() == ("pipeflow-plan: error: profile.json: layers[3].forward_ms must be a "
                                               "non-negative number, found -1")
    assert main([str(tmp_path / "missing.json"), "--workers", "2", "-o", str(tmp_path / "plan.json")]) == 2
    assert "cannot read profile" in capsys.readouterr().err


def test_memory_error_names_the_stage() -> None:
    # 8 layers of 4 MB weights: with adam one layer needs 16 MB + activations; 10 MB per worker cannot fit.
    with pytest.raises(PlanningError) as e:
        plan_from_profile(make_profile(), 4, schedule="1f1b", microbatches=4, memory_per_worker="10MB")
    msg = str(e.value)
    assert msg.startswith("no plan fits --memory-per-worker 9.54 MiB: even the fastest plan's stage ")
    found = re.search(r"stage (\d+) \(layers \[(\d+), (\d+)\), (\d+) replica\(s\)\) needs ([0-9.]+) MiB", msg)
    assert found and float(found.group(5)) > 9.54 and "\n" not in msg


def test_memory_limit_changes_the_plan() -> None:
    prof = make_profile(params=1_000, out=10_000_000)  # big activations to send: data parallel when it fits
    free = plan_from_profile(prof, 4, schedule="1f1b", microbatches=8)
    assert [s.replicas for s in free.stages] == [4]
    need = free.predicted["peak_memory_bytes"][0]
    tight = plan_from_profile(prof, 4, schedule="1f1b", microbatches=8, memory_per_worker=int(need * 0.8))
    assert len(tight.stages) > 1
    assert max(tight.predicted["peak_memory_bytes"]) <= need * 0.8


def test_auto_microbatches_reaches_the_bubble_target() -> None:
    prof = make_profile(params=0, out=0)
    for layer in prof.layers:  # uniform: the bubble is the fill/drain one, (S-1)/(m+S-1)
        layer.forward_ms, layer.backward_ms = 1.0, 2.0
    plan = plan_from_profile(prof, 4, schedule="1f1b", microbatches="auto", straight=True)
    m = plan.microbatches
    assert plan.predicted["bubble_fraction"] <= AUTO_BUBBLE
    smaller = plan_from_profile(prof, 4, schedule="1f1b", microbatches=m // 2, straight=True)
    assert smaller.predicted["bubble_fraction"] > AUTO_BUBBLE
    assert m == 32  # 3/35 <= 0.1 < 3/19


def test_in_process_api_defaults_and_topology_errors() -> None:
    plan = plan_from_profile(make_profile(), 4, schedule="gpipe", microbatches=4)
    assert plan.workers == 4 and plan.extra["planner"]["topology"] == "4x10GB/s"
    with pytest.raises(TopologyError, match="--workers 4 does not match --topology '8x1GB/s'"):
        plan_from_profile(make_profile(), 4, schedule="gpipe", microbatches=4, topology="8x1GB/s")
