"""`pipeflow-plan --schedule auto`: the flush schedule of highest predicted throughput under the memory limit,
checked by brute force through the CLI against each schedule planned by name."""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

import partitioner.auto as auto
from partitioner.cli import main
from partitioner.plan import Plan
from partitioner.profile import LayerProfile, Profile
from pipeflow.kinds import TABLE

FLUSH = [k.name for k in TABLE if k.flush]
# How the table names a record's candidate: "interleaved(virtual_stages=2)" for a record with variants.
LABEL = {k.name: k.name + "".join(f"({', '.join(f'{n}={x}' for n, x in v)})" for v in k.variants if v)
         for k in TABLE if k.flush}
NAMED_ONLY = [k.name for k in TABLE if not k.flush]


def random_profile(rng: random.Random, n: int) -> Profile:
    return Profile("mlp", {"layers": n}, "cpu", "float32", 2,
                   [LayerProfile(f"l{i}", rng.uniform(0.5, 3), rng.uniform(1, 6), rng.choice([1e4, 1e5, 1e6]),
                                 rng.uniform(1e5, 4e6), rng.choice([0, 1e5, 1e6, 8e6])) for i in range(n)])


def plan_cli(tmp: Path, profile: Path, args: list[str], name: str, capsys: pytest.CaptureFixture[str]
             ) -> tuple[int, str, str, Plan | None]:
    out = tmp / f"{name}.json"
    code = main([str(profile), *args, "-o", str(out)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err, Plan.load(out) if code == 0 else None


def shape(plan: Plan) -> tuple[object, ...]:
    return plan.schedule, plan.microbatches, tuple((st.layers, st.replicas, tuple(st.ranks)) for st in plan.stages)


@pytest.mark.parametrize("seed", range(12))
def test_auto_picks_the_best_named_flush_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  seed: int) -> None:
    rng = random.Random(seed)
    prof = tmp_path / "profile.json"
    random_profile(rng, rng.randint(2, 9)).save(prof)
    workers = rng.randint(1, 6)
    args = ["--workers", str(workers), "--microbatches", rng.choice(["auto", "4", "7"]),
            "--topology", rng.choice([f"{workers}x1GB/s", f"{workers}x100GB/s"])]
    if rng.random() < 0.5:
        args += ["--memory-per-worker", rng.choice(["30MB", "60MB", "200MB"])]
    named = {}
    for s in FLUSH:
        code, _, err, plan = plan_cli(tmp_path, prof, [*args, "--schedule", s], s, capsys)
        named[s] = plan if code == 0 else err.strip()
    code, out, err, got = plan_cli(tmp_path, prof, [*args, "--schedule", "auto"], "auto", capsys)
    ok = [s for s in FLUSH if isinstance(named[s], Plan)]
    if not ok:
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("pipeflow-plan: error: --schedule auto: no schedule has a plan: " + FLUSH[0] + ": ")
        return
    assert code == 0, err
    assert got is not None

    def key(s: str) -> tuple[float, float, int]:
        p = named[s]
        assert isinstance(p, Plan)
        return -p.predicted["samples_per_s"], max(p.predicted["peak_memory_bytes"]), FLUSH.index(s)

    best = min(ok, key=key)
    want = named[best]
    assert isinstance(want, Plan)
    assert shape(got) == shape(want) and got.predicted == want.predicted
    # The table: one row per flush record, a reason for each without a plan, and why the winner won.
    table = out.split("stage  ")[0]
    assert table.startswith("--schedule auto compared:")
    for s in FLUSH:
        assert any(line.split()[:1] == [LABEL[s]] for line in table.splitlines()[1:]), table
        if not isinstance(named[s], Plan):
            assert f"  {LABEL[s]}: " in table
    for s in NAMED_ONLY:
        assert f" {s} " not in table
    assert f"chose {best}: " in table
    rows = got.extra["planner"]["schedule_auto"]["candidates"]
    assert [r["schedule"] for r in rows] == FLUSH
    assert json.loads(json.dumps(rows)) == rows


def test_memory_limit_rules_out_gpipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gpipe keeps every microbatch's activations: under a limit only 1f1b fits, and the table says why."""
    prof = tmp_path / "profile.json"
    Profile("mlp", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 1.0, 2.0, 1000, 20e6, 1e3)
                                             for i in range(4)]).save(prof)
    code, out, err, plan = plan_cli(tmp_path, prof, ["--workers", "2", "--microbatches", "16", "--memory-per-worker",
                                                     "200MB", "--schedule", "auto"], "auto", capsys)
    assert code == 0, err
    assert plan is not None and plan.schedule == "1f1b"
    assert "  gpipe: no plan fits --memory-per-worker" in out
    assert "chose 1f1b: 1f1b and zb predict the same 166.7 samples/s and memory; 1f1b comes first" in out


def test_candidates_follow_the_table_and_its_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record added to the kind table joins --schedule auto; one with parameters joins once per variant;
    records without a flush never do."""
    assert [c.label for c in auto.candidates()] == [LABEL[s] for s in FLUSH]
    fake = (SimpleNamespace(name="gpipe", flush=True), SimpleNamespace(name="async", flush=False),
            SimpleNamespace(name="interleaved", flush=True, variants=({"virtual_stages": 2}, {"virtual_stages": 4})))
    monkeypatch.setattr(auto, "TABLE", fake)
    assert [c.label for c in auto.candidates()] == ["gpipe", "interleaved(virtual_stages=2)",
                                                    "interleaved(virtual_stages=4)"]
