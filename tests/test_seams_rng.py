"""Issue 10 items 1, 3 and 5: dropout draws per (seed, microbatch, layer), a profiling sandbox, the model's own
dtype; issue 11: pipeflow-profile refuses a microbatch that cannot fit."""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner.profiler import profile_model
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.spec import build_model
from pipeflow.stage import Stage
from tests.conftest import Case, MpiRun, batched, write_plan
from tests.reference import reference_flush, seed_of

DROP = "tests.models:dropout_mlp"
DROP_ARGS = {"layers": 4, "p": 0.3, "probe": True}
NORM = "tests.models:batchnorm_mlp"
STEPS, M, B, SEED = 3, 4, 2, 5
COMMON = ["--steps", str(STEPS), "--microbatches", str(M), "--microbatch-size", str(B), "--seed", str(SEED),
          "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--device", "cpu"]


def expected_draw(seed: int, t: int, i: int) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed_of(seed, t, i))))


def check_probes(stderr: str, *, microbatches: int, layers: int) -> None:
    """Every (microbatch, dropout layer) ran exactly once, and drew what (SEED, t, i) says."""
    spec = build_model(DROP, DROP_ARGS, seed=SEED)
    loader = MicrobatchLoader(spec.dataset, B, seed=SEED)
    t_of = {loader.indices(t)[0]: t for t in range(microbatches)}
    got = Counter((int(i), t_of[int(s)], float(d))
                  for i, s, d in re.findall(r"probe layer=(\d+) sample=(\d+) draw=(\S+)", stderr))
    want = Counter((i, t, expected_draw(SEED, t, i)) for t in range(microbatches) for i in range(layers - 1))
    assert got == want


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------------------------------------- pure


class Draw(nn.Module):
    """Records 32 uniform numbers from the default generator at each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.rand(32, dtype=torch.float64))
        return x


def test_draws_depend_on_seed_microbatch_and_layer_only() -> None:
    layers = [Draw() for _ in range(3)]
    stage = Stage(layers, start=4, first=True, last=False, loss_fn=None, device=torch.device("cpu"), seed=SEED)
    for t in (0, 1, 7, 0):
        stage.forward(t, torch.zeros(2, 3), global_mb=t)
    draws = {(t, 4 + k): layer.seen[n] for n, t in enumerate((0, 1, 7)) for k, layer in enumerate(layers)}
    keys = list(draws)
    for a in keys:  # masks differ across microbatches and layers
        for b in keys:
            assert a == b or not torch.equal(draws[a], draws[b]), (a, b)
    for layer in layers:  # microbatch 0 again: the same draws
        assert torch.equal(layer.seen[3], layer.seen[0])
    for (t, i), d in draws.items():  # global layer index start + k, independent formula
        want = torch.rand(32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed_of(SEED, t, i)))
        assert torch.equal(d, want)


def test_dropout_masks_differ_across_microbatches_and_layers() -> None:
    """nn.Dropout at global layer i on microbatch t: a mask per (t, i), the same on any stage object
    (another replica, another run) that holds layer i."""
    def mask(layer: int, t: int) -> torch.Tensor:
        stage = Stage([nn.Dropout(0.5)], start=layer, first=True, last=False, loss_fn=None,
                      device=torch.device("cpu"), seed=SEED)
        return stage.forward(t, torch.ones(64, dtype=torch.float64), global_mb=t)[0] != 0

    masks = {(t, i): mask(i, t) for t in range(3) for i in range(3)}
    for a in masks:
        for b in masks:
            assert a == b or not torch.equal(masks[a], masks[b]), (a, b)
    assert all(torch.equal(mask(i, t), m) for (t, i), m in masks.items())


def test_profile_model_leaves_the_model_and_rng_as_they_were() -> None:
    spec = build_model(NORM, {"p": 0.5})
    spec.layers[1].eval()  # a layer in eval mode stays in eval mode
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in spec.layers]
    modes = [m.training for layer in spec.layers for m in layer.modules()]
    rng = torch.get_rng_state()
    prof = profile_model(spec, 4, "cpu", dtype="float64", warmup=1, repeats=1)
    assert prof.dtype == "float64" and len(prof.layers) == len(spec.layers)
    for layer, state in zip(spec.layers, before):
        now = layer.state_dict()
        assert list(now) == list(state)
        for k in state:  # BatchNorm running stats and weights unchanged, still float32 on the cpu
            assert now[k].dtype == state[k].dtype and now[k].device == state[k].device
            assert torch.equal(now[k], state[k]), k
        assert all(p.grad is None for p in layer.parameters())
    assert [m.training for layer in spec.layers for m in layer.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)


def test_profile_keeps_the_models_dtype_without_dtype() -> None:
    spec = build_model(DROP, {"layers": 3, "p": 0.0, "dtype": "float64"})
    prof = profile_model(spec, 4, "cpu", warmup=0, repeats=1)
    assert prof.dtype == "float64"
    assert prof.layers[0].output_bytes == 4 * (8 + 1) * 8  # b x (hidden + id column) float64 numbers
    assert all(p.dtype == torch.float64 for layer in spec.layers for p in layer.parameters())


HOST = (r"its input and target take about \d+\.\d GiB \(\d+ bytes per 2 samples\) but this machine has \d+\.\d GiB "
        r"of RAM")
LAYER = (r"one layer needs about \d+\.\d GiB for its input, output and saved activations \(measured on 2 samples, "
         r"scaled\) but this machine's RAM has \d+\.\d GiB")


@pytest.mark.parametrize("model, args, size, text", [
    ("gpt", {}, 100_000_000, f"(?:{HOST}|{LAYER})"),  # issue 11's command: ~95 GiB of tokens alone
    ("mlp", {}, 10**12, HOST),
    ("gpt", {"seq_len": 8, "d_model": 512}, 10**7, LAYER),  # 1.3 GB of tokens, terabytes of activations
])
def test_profile_refuses_a_microbatch_that_cannot_fit(tmp_path: Path, capfd: pytest.CaptureFixture[str], model: str,
                                                     args: dict[str, int], size: int, text: str) -> None:
    """At once (before collating it), one line, exit 2 (pipeflow-profile's main in this process; the console
    script itself is test_partitioner_profile.py's test_profile_cli)."""
    from partitioner.profiler import main

    out = tmp_path / "profile.json"
    code = main(["--model", model, "--model-args", json.dumps(args), "--microbatch-size", str(size), "-o", str(out)])
    err = capfd.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert re.fullmatch(rf"pipeflow-profile: error: --microbatch-size {size} cannot work: {text}; use a smaller "
                        r"--microbatch-size", lines[0]), lines[0]
    assert not out.exists()


def test_dropout_benchmark_prints_its_line_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark script's main in this process (it would start python and torch again)."""
    import importlib.util

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "bench_dropout_rng.py"
    spec = importlib.util.spec_from_file_location("bench_dropout_rng", bench)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng, dtype = torch.get_rng_state(), torch.get_default_dtype()
    try:
        assert module.main(["--iters", "2", "--rounds", "1"]) == 0
    finally:
        torch.set_rng_state(rng)
        torch.set_default_dtype(dtype)
    proc = capsys.readouterr()
    ms = r"(\d+\.\d{3})"
    m = re.fullmatch(rf"bench_dropout_rng: cpu, gpt 2x64 seq 32 microbatch 4 float32, dropout 0.1: seeded {ms} "
                     rf"ms/microbatch, plain {ms} ms/microbatch, ratio (\d+\.\d{{3}}) \(no dropout {ms} ms; 4 seeded "
                     r"layers per microbatch\)\n", proc.out)
    assert m, proc.out
    seeded, plain, ratio = float(m.group(1)), float(m.group(2)), float(m.group(3))
    assert seeded > 0 and plain > 0 and ratio == pytest.approx(seeded / plain, abs=2e-3)


# ---------------------------------------------------------------------------------------------- mpirun


def _drop_run(d: Path, name: str, np_: int, extra: list[str]) -> Case:
    return Case(np_, ["--model", DROP, "--model-args", json.dumps(DROP_ARGS), *COMMON, "--dtype", "float64", *extra,
                      "--save", str(d / f"{name}.pt")])


def dropout_plans(d: Path) -> list[Case]:
    plan = d / "plan.json"
    write_plan(plan, "1f1b", M, [(2, 2), (2, 1)])
    # -np 1, 2, 3: the order the cases of other tests need (test_checkpoint's resume goes from -np 2 to 3).
    return [_drop_run(d, "np1", 1, ["--layers-per-stage", "even", "--schedule", "1f1b"]),
            _drop_run(d, "straight", 2, ["--layers-per-stage", "even", "--schedule", "gpipe"]),
            _drop_run(d, "replicated", 3, ["--plan", str(plan)])]


@batched(dropout_plans)
def test_dropout_trains_the_same_whatever_the_plan(mpi: MpiRun) -> None:
    """-np 1, a replicated stage (2+1 ranks) and a straight 2-stage pipeline: the reference's weights."""
    want = reference_flush(DROP, DROP_ARGS, steps=STEPS, microbatches=M, microbatch_size=B, optimizer="sgd",
                           lr=0.1, momentum=0.9, seed=SEED)
    initial = reference_flush(DROP, DROP_ARGS, steps=0, microbatches=M, microbatch_size=B, seed=SEED)
    assert any(not torch.equal(want[k], initial[k]) for k in want)
    for name, proc in zip(["np1", "straight", "replicated"], mpi.procs, strict=True):
        check_probes(proc.stderr, microbatches=STEPS * M, layers=DROP_ARGS["layers"])
        assert_same(torch.load(mpi.dir / f"{name}.pt", weights_only=True), want)


def async_dropout(d: Path) -> list[Case]:
    plan = d / "plan.json"
    write_plan(plan, "2bw", M, [(2, 2), (2, 1)])
    return [_drop_run(d, "np1", 1, ["--layers-per-stage", "even", "--schedule", "2bw"]),
            _drop_run(d, "replicated", 3, ["--plan", str(plan)]),
            _drop_run(d, "async", 3, ["--plan", str(plan), "--schedule", "async"])]


@batched(async_dropout)
def test_asynchronous_schedules_draw_per_microbatch_and_layer(mpi: MpiRun) -> None:
    """2bw's weights do not depend on the plan (-np 1 and a replicated stage agree); async (weight stashing)
    draws per (seed, t, i) on every replica."""
    saved = []
    for name, proc in zip(["np1", "replicated", "async"], mpi.procs):
        check_probes(proc.stderr, microbatches=STEPS * M, layers=DROP_ARGS["layers"])
        saved.append(torch.load(mpi.dir / f"{name}.pt", weights_only=True))
    assert_same(saved[1], saved[0])


def batchnorm_on_the_spot(d: Path) -> Case:
    args = {"layers": 4, "p": 0.0, "report_alive": True}
    return Case(2, ["--model", NORM, "--model-args", json.dumps(args), *COMMON, "--dtype", "float64", "--straight",
                    "--schedule", "1f1b", "--save", str(d / "model.pt")], env={"PIPEFLOW_LOG": "INFO"})


@batched(batchnorm_on_the_spot)
def test_on_the_spot_plan_leaves_batchnorm_alone_and_frees_other_stages(mpi: MpiRun) -> None:
    """No --plan: rank 0 profiles a BatchNorm model in a sandbox, so the run equals the reference, buffers
    included; after set-up each rank holds only its own stage's layers."""
    args = {"layers": 4, "p": 0.0}
    proc = mpi.proc
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush(NORM, args, steps=STEPS, microbatches=M, microbatch_size=B, optimizer="sgd", lr=0.1,
                           momentum=0.9, seed=SEED)
    assert any("running_mean" in k for k in want)
    assert_same(got, want)
    assert "profiled 4 layers on cpu in float64 and planned for 2 workers" in proc.stderr
    stages = re.search(r"stages \[\(\[0, (\d)\], \[0\]\), \(\[\d, 4\], \[1\]\)\]", proc.stderr)
    assert stages, proc.stderr
    cut = int(stages.group(1))
    last = {int(r): json.loads(a) for r, a in re.findall(r"rank=(\d) alive layers=(\[[\d, ]*\])", proc.stderr)}
    assert last[0] == list(range(cut))  # rank 0 profiled every layer, then let stage 1's go
    if 1 in last:  # rank 1 reports only if stage 1 has a NormLayer
        assert last[1] == list(range(cut, 4))


F64_ARGS = {"layers": 4, "p": 0.0, "dtype": "float64"}


def float64_model(d: Path) -> Case:
    return Case(2, ["--model", DROP, "--model-args", json.dumps(F64_ARGS), *COMMON, "--layers-per-stage", "even",
                    "--save", str(d / "model.pt")])


@batched(float64_model)
def test_float64_model_trains_in_float64_without_dtype(mpi: MpiRun) -> None:
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    assert all(v.dtype == torch.float64 for v in got.values())
    assert_same(got, reference_flush(DROP, F64_ARGS, steps=STEPS, microbatches=M, microbatch_size=B, optimizer="sgd",
                                     lr=0.1, momentum=0.9, seed=SEED))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
