"""`--global-batch G`: the planner picks the microbatch size b and count m = G / b among the sizes a profile
holds, checked by brute force over (b, m) through the CLI; the multi-size profile format."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from partitioner.cli import main
from partitioner.plan import Plan
from partitioner.profile import LayerProfile, Profile, ProfileError


def at_size(rng: random.Random, n: int, b: int, speed: list[float]) -> Profile:
    """The same layers at microbatch size b: compute grows sublinearly in b (per-layer efficiency
    `speed`), bytes linearly."""
    return Profile("mlp", {"layers": n}, "cpu", "float32", b,
                   [LayerProfile(f"l{i}", speed[i] * b ** 0.7, 2 * speed[i] * b ** 0.7, 2e5 * b, 1e6 * b, 4e6)
                    for i in range(n)], loss_ms=0.1 * b, optimizer_ms_per_byte={"adam": 1e-7})


def multi(rng: random.Random, n: int, sizes: list[int]) -> Profile:
    speed = [rng.uniform(0.5, 3) for _ in range(n)]
    first, *others = [at_size(rng, n, b, speed) for b in sizes]
    first.others = others
    return first


def run(tmp: Path, profile: Path, args: list[str], capsys: pytest.CaptureFixture[str], name: str = "plan"
        ) -> tuple[int, str, str, Plan | None]:
    out = tmp / f"{name}.json"
    code = main([str(profile), *args, "-o", str(out)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err, Plan.load(out) if code == 0 else None


@pytest.mark.parametrize("seed", range(10))
def test_global_batch_picks_the_best_size_and_count(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    seed: int) -> None:
    rng = random.Random(seed)
    n, sizes = rng.randint(2, 8), rng.sample([1, 2, 3, 4, 8], rng.randint(1, 4))
    prof = multi(rng, n, sizes)
    path = tmp_path / "profile.json"
    prof.save(path)
    g = rng.choice([8, 12, 16, 24])
    args = ["--workers", str(rng.randint(1, 5)), "--schedule", rng.choice(["1f1b", "gpipe", "auto"])]
    if rng.random() < 0.5:
        args += ["--memory-per-worker", rng.choice(["60MB", "150MB"])]
    brute = {}
    for p in prof.at_sizes():
        if g % p.microbatch_size:
            continue
        single = tmp_path / f"profile{p.microbatch_size}.json"  # not -o's b{size}.json: the profile stays
        Profile(p.model, p.model_args, p.device, p.dtype, p.microbatch_size, p.layers, p.loss_ms,
                p.optimizer_ms_per_byte).save(single)
        code, _, _, plan = run(tmp_path, single, [*args, "--microbatches", str(g // p.microbatch_size)], capsys,
                               f"b{p.microbatch_size}")
        if plan is not None:
            brute[p.microbatch_size] = plan
    code, out, err, got = run(tmp_path, path, [*args, "--global-batch", str(g)], capsys)
    if not any(g % b == 0 for b in sizes):
        assert code == 2 and err.startswith(f"pipeflow-plan: error: --global-batch {g} is not a multiple of any "
                                            "profiled microbatch size") and err.count("\n") == 1
        return
    if not brute:
        assert code == 2 and f"--global-batch {g}: no microbatch size has a plan: " in err, err
        return
    assert code == 0, err
    assert got is not None
    best = min(brute, key=lambda b: (-brute[b].predicted["samples_per_s"], max(brute[b].predicted["peak_memory_bytes"]),
                                     b))
    want = brute[best]
    assert got.extra["planner"]["microbatch_size"] == best and got.microbatches == g // best
    assert (got.schedule, [(s.layers, s.ranks) for s in got.stages], got.predicted) == \
        (want.schedule, [(s.layers, s.ranks) for s in want.stages], want.predicted)
    assert out.startswith(f"--global-batch {g} compared:")
    assert f"chose microbatch size {best} x {g // best} microbatches" in out
    rows = got.extra["planner"]["global_batch"]["candidates"]
    assert sorted(r["microbatch_size"] for r in rows) == sorted(b for b in sizes if g % b == 0)


def test_global_batch_flag_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profile.json"
    multi(random.Random(0), 4, [2, 4]).save(path)
    for extra, message in ((["--microbatches", "4"], "--global-batch chooses the microbatch count; drop "
                                                     "--microbatches"),
                           (["--global-batch", "0"], "--global-batch must be a positive integer, found 0")):
        args = ["--workers", "2", *(["--global-batch", "8"] if "--global-batch" not in extra else []), *extra]
        code, _, err, _ = run(tmp_path, path, args, capsys)
        assert code == 2 and err == f"pipeflow-plan: error: {message}\n"


def test_multi_size_profile_format(tmp_path: Path) -> None:
    """The top level is a one-size profile (what older readers see); the other sizes round-trip; bad ones
    are named."""
    prof = multi(random.Random(1), 3, [4, 2, 8])
    path = tmp_path / "p.json"
    prof.save(path)
    d = json.loads(path.read_text())
    assert d["format"] == "pipeflow.profile/1" and d["microbatch_size"] == 4
    assert [o["microbatch_size"] for o in d["other_microbatch_sizes"]] == [2, 8]
    back = Profile.load(path)
    assert back == prof and [p.microbatch_size for p in back.at_sizes()] == [2, 4, 8]
    d["other_microbatch_sizes"][1]["microbatch_size"] = 4
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"^p\.json: other_microbatch_sizes\[1\]: microbatch_size 4 appears twice"):
        Profile.load(path)


def test_profiler_writes_several_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from partitioner.profiler import main as profile_main
    out = tmp_path / "p.json"
    assert profile_main(["--model", "mlp", "--model-args", '{"layers": 2, "hidden": 8}', "--microbatch-sizes", "2,4",
                         "--warmup", "0", "--repeats", "1", "-o", str(out)]) == 0
    prof = Profile.load(out)
    assert [p.microbatch_size for p in prof.at_sizes()] == [2, 4] and prof.microbatch_size == 2
    assert prof.others[0].layers[0].output_bytes == 2 * prof.layers[0].output_bytes
    assert "also at microbatch sizes 4" in capsys.readouterr().out
    for args, message in ((["--microbatch-sizes", "2,2"], "--microbatch-sizes must be distinct positive integers"),
                          (["--microbatch-size", "2", "--microbatch-sizes", "4"], "give exactly one of"),
                          ([], "give exactly one of")):
        assert profile_main(["--model", "mlp", *args, "-o", str(tmp_path / "q.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pipeflow-profile: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("flags,message", [
    ({"global_batch": 0}, "--global-batch must be >= 1, found 0"),
    ({"plan": "plan.json"}, "--global-batch chooses the microbatch size and count when planning on the spot"),
    ({"microbatches": 4}, "drop --plan, --layers-per-stage and --microbatches"),
    ({"layers_per_stage": "even"}, "drop --plan, --layers-per-stage and --microbatches"),
])
def test_train_global_batch_conflicts(flags: dict[str, object], message: str) -> None:
    """pipeflow-train --global-batch plans on the spot only: refused, before any profiling, with a plan,
    a hand split or a microbatch count."""
    from argparse import Namespace

    from pipeflow.failure import UsageError
    from pipeflow.planning import make_plan
    from pipeflow.spec import build_model

    args = Namespace(**{"global_batch": 8, "plan": None, "layers_per_stage": None, "microbatches": None,
                        "microbatch_size": 0, "topology": None, "straight": False, "memory_per_worker": None, **flags})
    with pytest.raises(UsageError, match=message):
        make_plan(args, build_model("mlp", {"layers": 2}), 2, 0, None)


class _OneHost:
    """The control channel of 2 ranks on one host, as planning on the spot uses it, for rank 0 in-process."""

    def allgather(self, obj: object) -> list[object]:
        return [obj, obj]

    def bcast(self, obj: object, root: int = 0) -> object:
        return obj


def test_on_the_spot_plans_within_the_machines_memory(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Without --memory-per-worker a plan made on the spot must fit this host's RAM shared by its ranks (on CUDA,
    the GPU's memory): a host too small for any plan gets one line naming where the limit came from, instead of
    a plan that runs out of memory in training; --memory-per-worker overrides it."""
    from partitioner import measure
    from pipeflow.failure import UsageError
    from pipeflow.planning import make_plan
    from pipeflow.spec import build_model
    from pipeflow.train import build_parser

    spec = build_model("mlp", {"layers": 6, "hidden": 512})  # 2 stages need about 8.5 MiB each with Adam
    args = build_parser().parse_args(["--model", "mlp", "--schedule", "1f1b", "--microbatches", "4",
                                      "--microbatch-size", "8", "--device", "cpu"])  # on a GPU host too
    monkeypatch.setattr(measure, "machine_bytes", lambda device: (12 * 2**20, "this machine's RAM"))
    with caplog.at_level("INFO", logger="pipeflow"), pytest.raises(UsageError) as e:
        make_plan(args, spec, 2, 0, _OneHost())
    assert str(e.value).startswith("planning on the spot failed: no plan fits --memory-per-worker 6.00 MiB")
    assert str(e.value).endswith("(the limit is this machine's RAM, 0.0 GiB, shared by its 2 ranks; "
                                 "--memory-per-worker sets another)")
    assert "planning on the spot under 0.01 GiB per worker" in caplog.text
    monkeypatch.setattr(measure, "machine_bytes", lambda device: (20 * 2**20, "this machine's RAM"))
    plan = make_plan(args, spec, 2, 0, _OneHost())
    assert [st.replicas for st in plan.stages] == [1, 1]
    assert all(peak <= 10 * 2**20 for peak in plan.predicted["peak_memory_bytes"])
    args.memory_per_worker = "1GiB"  # the flag wins over the machine
    assert make_plan(args, spec, 2, 0, _OneHost()).stages
    from pipeflow.planning import spot_memory

    assert spot_memory(args, "cuda", 2) == ("1GiB", "")
    args.memory_per_worker = None  # a GPU is each rank's own; a tenth is left to the context, NCCL, the allocator
    monkeypatch.setattr(measure, "machine_bytes", lambda device: (80 * 2**30, f"GPU {device}"))
    assert spot_memory(args, "cuda", 2) == (int(0.9 * 80 * 2**30), "GPU cuda, 80.0 GiB, 90% of it")


def test_on_the_spot_a_gpus_peak_memory_is_training_s_not_the_profile_s(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """On 2 H100s planning on the spot reported rank 0's peak as 17.39 GiB for a training that peaks at 13.82 (the
    same plan given): the profile's own peak. After profiling on a GPU the peak is logged apart, the cache freed
    and the peak reset; on CPU nothing is touched."""
    import torch

    from pipeflow.planning import forget_profiling

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: calls.append("peak") or 17.39 * 2**30)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    forget_profiling("cpu")
    assert calls == []
    with caplog.at_level("INFO", logger="pipeflow"):
        forget_profiling("cuda")
    assert calls == ["peak", "empty", "reset"]
    assert "profiling on the spot peaked at 17.39 GiB of this GPU (not in training's peak below)" in caplog.text
    # the profiles' own record wins where it is higher: measuring the loss's memory resets CUDA's peak midway
    with caplog.at_level("INFO", logger="pipeflow"):
        forget_profiling("cuda", 20 * 2**30)
    assert "profiling on the spot peaked at 20.00 GiB of this GPU" in caplog.text


def test_evaluate_prices_a_plan_at_the_size_it_was_made_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """A --global-batch plan at b = 4, priced again on its multi-size profile (top level b = 1), is priced at
    b = 4 (it was priced at the top level's b = 1: a wrong step time with no warning)."""
    prof = multi(random.Random(3), 4, [1, 4, 8])
    path = tmp_path / "profile.json"
    prof.save(path)
    code, _, _, planned = run(tmp_path, path, ["--workers", "2", "--global-batch", "16", "--schedule", "1f1b"],
                              capsys)
    assert code == 0 and planned is not None
    b = planned.extra["planner"]["microbatch_size"]
    assert b != 1
    code, _, _, priced = run(tmp_path, path, ["--evaluate", str(tmp_path / "plan.json")], capsys, "priced")
    assert code == 0 and priced is not None
    assert priced.extra["planner"]["microbatch_size"] == b
    assert priced.predicted["step_ms"] == pytest.approx(planned.predicted["step_ms"], rel=1e-9)
