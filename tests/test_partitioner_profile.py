"""profile.json round trip and validation messages; the profiler on the built-in models."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from partitioner.measure import tensors
from partitioner.profile import LayerProfile, Profile, ProfileError
from partitioner.profiler import profile_model
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.spec import ModelSpec, build_model
from tests.conftest import base_env, in_background

GOOD: dict[str, Any] = {
    "format": "pipeflow.profile/1", "model": "gpt", "model_args": {"layers": 4}, "device": "cpu",
    "dtype": "float32", "microbatch_size": 2,
    "layers": [{"name": f"l{i}", "forward_ms": 0.8 + i, "backward_ms": 1.7, "output_bytes": 65536,
                "activation_bytes": 262144, "parameter_bytes": 1048576} for i in range(4)]}


def write(tmp_path: Path, d: Any) -> Path:
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(d))
    return p


def test_round_trip(tmp_path: Path) -> None:
    prof = Profile.load(write(tmp_path, GOOD))
    assert prof.layers[3] == LayerProfile("l3", 3.8, 1.7, 65536, 262144, 1048576)
    out = tmp_path / "again.json"
    prof.save(out)
    assert json.loads(out.read_text()) == GOOD
    assert Profile.load(out) == prof


def test_timing_is_recorded_and_checked(tmp_path: Path) -> None:
    """How a CUDA profile's layers were timed (pipeflow-profile --timing) survives a round trip; a CPU profile
    has none; anything else is refused by name."""
    prof = Profile.load(write(tmp_path, {**GOOD, "device": "cuda", "timing": "kernels"}))
    assert prof.timing == "kernels"
    prof.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["timing"] == "kernels"
    assert "timing" not in Profile.load(write(tmp_path, GOOD)).to_json()
    with pytest.raises(ProfileError,
                       match=r"profile.json: timing must be one of idle, kernels, stage, graphs, found \"fast\""):
        Profile.load(write(tmp_path, {**GOOD, "timing": "fast"}))
    assert profile_model(build_model("mlp", {"layers": 2, "hidden": 8}), 2, "cpu", warmup=0, repeats=1,
                         optimizer=None).timing is None
    with pytest.raises(ProfileError, match="--timing kernels times CUDA kernels: it needs --device cuda, found cpu"):
        profile_model(build_model("mlp", {"layers": 2, "hidden": 8}), 2, "cpu", timing="kernels")


def _broken(path: str, value: Any) -> dict[str, Any]:
    d = copy.deepcopy(GOOD)
    *keys, last = path.split(".")
    target: Any = d
    for k in keys:
        target = target[int(k)] if isinstance(target, list) else target[k]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return d


_DELETE = object()


@pytest.mark.parametrize("path,value,message", [
    ("layers.3.forward_ms", -1, "profile.json: layers[3].forward_ms must be a non-negative number, found -1"),
    ("layers.0.backward_ms", "fast", 'profile.json: layers[0].backward_ms must be a non-negative number, found "fast"'),
    ("layers.1.output_bytes", None, "profile.json: layers[1].output_bytes must be a non-negative number, found null"),
    ("layers.2.activation_bytes", True,
     "profile.json: layers[2].activation_bytes must be a non-negative number, found true"),
    ("layers.2.parameter_bytes", -5, "profile.json: layers[2].parameter_bytes must be a non-negative number, found -5"),
    ("layers.2.parameter_bytes", _DELETE, "profile.json: layers[2]: missing field 'parameter_bytes'"),
    ("layers.1.name", 7, "profile.json: layers[1].name must be a string, found 7"),
    ("format", "pipeflow.profile/0", "profile.json: format is \"pipeflow.profile/0\", expected 'pipeflow.profile/1'"),
    ("microbatch_size", 0, "profile.json: microbatch_size must be a positive integer, found 0"),
    ("microbatch_size", _DELETE, "profile.json: missing field 'microbatch_size'"),
    ("dtype", "int8", 'profile.json: dtype must be one of float32, bfloat16, float16, float64, found "int8"'),
    ("layers", [], "profile.json: layers is empty: expected one entry per model layer"),
    ("layers", {"a": 1}, 'profile.json: layers must be a list, found {"a": 1}'),
    ("model_args", [1], "profile.json: model_args must be an object, found [1]"),
])
def test_validation_messages(tmp_path: Path, path: str, value: Any, message: str) -> None:
    with pytest.raises(ProfileError) as e:
        Profile.load(write(tmp_path, _broken(path, value)))
    assert str(e.value) == message


def test_not_json_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "profile.json"
    p.write_text("{oops")
    with pytest.raises(ProfileError, match=r"profile.json: not valid JSON \(Expecting property name"):
        Profile.load(p)
    with pytest.raises(ProfileError, match="cannot read profile .*nope.json: No such file"):
        Profile.load(tmp_path / "nope.json")


def _output_bytes(spec: Any, b: int) -> list[int]:
    x, _ = MicrobatchLoader(spec.dataset, b).microbatch(0)
    sizes = []
    with torch.no_grad():
        for layer in spec.layers:
            x = layer(x)
            sizes.append(sum(t.numel() * t.element_size() for t in tensors(x)))
    return sizes


@pytest.mark.parametrize("model,args", [("mlp", {"layers": 5, "hidden": 32}),
                                        ("gpt", {"layers": 2, "d_model": 32, "heads": 2, "seq_len": 16,
                                                 "dataset": "synthetic", "dataset_size": 64})])
def test_profiler_on_builtin_models(model: str, args: dict[str, Any]) -> None:
    spec = build_model(model, args)
    prof = profile_model(spec, 4, "cpu", warmup=1, repeats=3)
    assert len(prof.layers) == len(spec.layers)
    assert (prof.model, prof.model_args, prof.device, prof.dtype, prof.microbatch_size) == \
        (model, args, "cpu", "float32", 4)
    for layer in prof.layers:
        assert layer.forward_ms > 0 and layer.backward_ms > 0
        assert layer.output_bytes > 0 and layer.activation_bytes > 0 and layer.parameter_bytes > 0
    ref = build_model(model, args)
    assert [layer.output_bytes for layer in prof.layers] == _output_bytes(ref, 4)
    assert [layer.parameter_bytes for layer in prof.layers] == \
        [sum(p.numel() * 4 for p in m.parameters()) for m in ref.layers]


def test_activation_bytes_of_a_linear_layer() -> None:
    # Linear(16, 8) keeps its input (4 x 16 floats) for the weight gradient; ReLU keeps its output.
    spec = build_model("mlp", {"layers": 2, "d_in": 16, "hidden": 8, "classes": 3})
    prof = profile_model(spec, 4, "cpu", warmup=0, repeats=1)
    first = prof.layers[0]  # fc(x) -> relu(h), h
    assert first.activation_bytes == 4 * 16 * 4 + 4 * 8 * 4
    assert first.output_bytes == 2 * 4 * 8 * 4


def test_activation_bytes_count_intermediates_the_allocator_would_reuse() -> None:
    """Three saved tensors of one size, two of them intermediates freed as soon as saved: their addresses
    come back for the next one. Counted by address alone they were one (a GPT block on a GPU measured 14 of
    the 16 activation-sized tensors it saves); the measurement keeps their storage until it ends."""
    from partitioner.layermem import saved_bytes

    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cos(torch.sin(x * 3) * 5).tanh()  # saves x*3, sin(.)*5 and the tanh's output

    x = torch.randn(1024, 256, requires_grad=True)
    assert saved_bytes(Chain(), x) == 3 * x.numel() * 4


def test_the_loss_memory_beyond_its_input_is_profiled(tmp_path: Path) -> None:
    """loss_bytes (CPU): what the loss saves beyond its input and target, plus its input's gradient."""
    from partitioner.layermem import loss_bytes

    out, target = torch.randn(64, 32, dtype=torch.float64), torch.randn(64, 32, dtype=torch.float64)
    # sin saves out*3 (64 x 32 doubles); mul saves the target (given already); the gradient of out: 64 x 32
    got = loss_bytes(lambda o, y: ((o * 3).sin() * y).sum(), out, target, torch.device("cpu"))
    assert got == (2 * 64 * 32 * 8, 64 * 32 * 8)  # and of it, what the backward keeps: out * 3
    spec = build_model("gpt", {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256})
    prof = profile_model(spec, 2, "cpu", warmup=0, repeats=1)
    # cross_entropy on fp32 logits keeps their log-softmax (2 x 8 x 256 floats), and their gradient as much
    assert prof.loss_bytes is not None and prof.loss_bytes >= 2 * (2 * 8 * 256 * 4)
    assert prof.loss_saved_bytes is not None and prof.loss_saved_bytes >= 2 * 8 * 256 * 4
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").loss_bytes == prof.loss_bytes
    with pytest.raises(ProfileError, match=r"^profile.json: loss_bytes must be a number in \[0, "):
        Profile.load(write(tmp_path, {**GOOD, "loss_bytes": -1}))


@in_background
def test_profile_cli(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "partitioner.profiler", "--model", "mlp", "--model-args",
                        '{"layers": 3}', "--microbatch-size", "2", "--warmup", "0", "--repeats", "1", "-o", str(out)],
                       capture_output=True, text=True, timeout=120, env=base_env())
    assert r.returncode == 0, r.stderr
    assert len(Profile.load(out).layers) == 3


@pytest.mark.parametrize("args,message", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--model", "mlp", "--model-args", "{bad"], "--model-args must be a JSON object"),
    (["--model", "mlp", "--model-args", '{"width": 3}'], "do not fit model 'mlp'"),
    (["--model", "mlp", "--model-args", '{"layers": 1}'], "mlp needs layers >= 2"),
    (["--model", "mlp", "--repeats", "0"], "need --warmup >= 0 and --repeats >= 1"),
    (["--model", "mlp", "--timing", "kernels"], "--timing kernels times CUDA kernels: it needs --device cuda, "
                                                "found cpu"),
])
def test_profile_cli_bad_model(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                               message: str) -> None:
    from partitioner.profiler import main
    assert main([*args, "--microbatch-size", "2", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("pipeflow-profile: error: ")
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()



class Probe(torch.nn.Module):
    """A linear layer that records the torch thread count it runs with and sleeps `slow_ms` on call `slow_call`."""

    threads: list[int] = []

    def __init__(self, slow_call: int = -1, slow_ms: float = 0.0) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.calls, self.slow_call, self.slow_ms = 0, slow_call, slow_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Probe.threads.append(torch.get_num_threads())
        if self.calls == self.slow_call:
            time.sleep(self.slow_ms / 1e3)
        self.calls += 1
        return self.fc(x)


def probe_model(slow_call: int = -1, slow_ms: float = 0.0) -> ModelSpec:
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 4, (8,)))
    return ModelSpec([Probe(slow_call, slow_ms), torch.nn.Linear(4, 4)], torch.nn.functional.cross_entropy, data)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_profile_fills_the_fields_training_needs(tmp_path: Path, optimizer: str) -> None:
    """Backward with gradient accumulation per layer, the loss, and the optimizer step per parameter byte
    (issue 13): filled, written and read back, and used by the planner's cost columns."""
    spec = build_model("mlp", {"layers": 3, "hidden": 32})
    prof = profile_model(spec, 4, "cpu", warmup=1, repeats=2, optimizer=optimizer)
    assert all(layer.backward_accumulate_ms is not None and layer.backward_accumulate_ms > 0 for layer in prof.layers)
    assert prof.loss_ms is not None and prof.loss_ms > 0
    assert list(prof.optimizer_ms_per_byte) == [optimizer] and prof.optimizer_ms_per_byte[optimizer] > 0
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    from partitioner.service import layer_costs
    lay = layer_costs(prof, "1f1b", optimizer)
    assert lay.loss_ms == prof.loss_ms and lay.optimizer_ms_per_byte == prof.optimizer_ms_per_byte[optimizer]
    assert list(lay.backward_ms) == [layer.backward_accumulate_ms for layer in prof.layers]
    assert not profile_model(spec, 4, "cpu", warmup=0, repeats=1, optimizer=None).optimizer_ms_per_byte


def test_profile_runs_with_the_thread_count_of_a_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pipeflow-profile on CPU times the layers with 1 torch thread, as a rank under mpirun runs, and puts
    the process's count back; another count is stated and warned about."""
    from partitioner.profiler import main
    torch.set_num_threads(2)
    Probe.threads = []
    profile_model(probe_model(), 2, "cpu", warmup=0, repeats=1, threads=1)
    assert set(Probe.threads) == {1} and torch.get_num_threads() == 2
    Probe.threads = []
    assert main(["--model", "tests.test_partitioner_profile:probe_model", "--microbatch-size", "2", "--warmup", "0",
                 "--repeats", "1", "-o", str(tmp_path / "p.json")]) == 0
    cap = capsys.readouterr()
    assert set(Probe.threads) == {1} and "1 torch thread(s)" in cap.out and not cap.err
    assert torch.get_num_threads() == 2
    Probe.threads = []
    assert main(["--model", "tests.test_partitioner_profile:probe_model", "--microbatch-size", "2", "--warmup", "0",
                 "--repeats", "1", "--threads", "2", "-o", str(tmp_path / "p.json")]) == 0
    cap = capsys.readouterr()
    assert set(Probe.threads) == {2}
    assert cap.err == ("pipeflow-profile: warning: --threads 2: ranks under mpirun run 1 torch thread each, so layer "
                       "times measured here will not match training\n")


def test_noisy_repeats_are_reported() -> None:
    """One repeat 40 ms slower than the others (a busy machine): the profile says so in one warning line."""
    # Calls of the measured copy's forward: its output (0), its saved tensors (1), then two forwards per
    # repeat, the first of each counted in the spread (the second accumulates): with one warm-up (2, 3),
    # call 6 is the second measured repeat's counted forward. (The memory check runs on another copy.)
    warnings: list[str] = []
    profile_model(probe_model(slow_call=6, slow_ms=40), 2, "cpu", warmup=1, repeats=3, threads=1, warnings=warnings)
    assert len(warnings) == 1 and warnings[0].startswith("timings vary between repeats: the slowest of 3 passes")
    quiet: list[str] = []
    profile_model(probe_model(), 2, "cpu", warmup=0, repeats=1, threads=1, warnings=quiet)
    assert quiet == []  # one repeat cannot disagree with itself
    from partitioner.measure import noise_warning, spread
    assert spread([10.0, 11.0, 12.0]) == pytest.approx(12 / 11) and noise_warning(12 / 11, 3) is None
    assert "took 1.50 x the median" in (noise_warning(1.5, 3) or "")


def test_measured_link_bandwidth_is_the_default_topology(tmp_path: Path) -> None:
    """A profile taken on a host with several GPUs records their copy bandwidth; pipeflow-plan without
    --topology plans on one level at that bandwidth instead of the 10 GB/s guess (issue 13)."""
    from partitioner.measure import gpu_link_bandwidth
    from partitioner.plan import Plan
    from partitioner.service import evaluate_plan, plan_detailed

    assert gpu_link_bandwidth(torch.device("cpu")) is None  # and profile_model leaves the field out on cpu
    prof = Profile.load(write(tmp_path, {**GOOD, "device": "cuda", "link_bandwidth": 150e9}))
    assert prof.link_bandwidth == 150e9
    prof.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["link_bandwidth"] == 150e9
    plan = plan_detailed(prof, 4, microbatches=4).plan
    assert plan.extra["planner"]["topology"] == "4x150GB/s"
    assert plan_detailed(prof, 4, microbatches=4, topology="4x1GB/s").plan.extra["planner"]["topology"] == "4x1GB/s"
    assert evaluate_plan(prof, Plan.from_json(plan.to_json())).plan.extra["planner"]["topology"] == "4x150GB/s"
    assert plan_detailed(Profile.load(write(tmp_path, GOOD)), 4, microbatches=4).plan.extra["planner"][
        "topology"] == "4x10GB/s"
    with pytest.raises(ProfileError, match=r"link_bandwidth must be a number of bytes/s from 1000 \(1 kB/s\) to "
                                           r"below 1.15292e\+18, found -1$"):
        Profile.load(write(tmp_path, {**GOOD, "link_bandwidth": -1}))


@pytest.mark.parametrize("timing", ["idle", "stage"])
def test_profiling_leaves_no_tensor_alive(timing: str) -> None:
    # Planning on the spot profiles in rank 0 before training: whatever profiling keeps stays on its GPU for the
    # whole run (the saved-activation probe once kept every layer's activations through a reference cycle).
    import gc
    import warnings

    from partitioner.profiler import profile_model
    from pipeflow.spec import build_model

    def alive() -> int:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on every object touches torch's deprecated aliases
            warnings.simplefilter("ignore", FutureWarning)
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    spec = build_model("gpt", {"layers": 2, "d_model": 32, "heads": 2, "seq_len": 16, "vocab": 256}, seed=0)
    before = alive()
    profile_model(spec, 2, "cpu", warmup=0, repeats=1, timing=timing)
    assert alive() == before


def test_the_profile_times_a_weight_copy_with_the_optimizer():
    """copy_ms_per_byte (what async and 2bw pay to keep a weight version) is timed with the optimizer's update,
    and round-trips through the file; without an optimizer neither is timed."""
    spec = build_model("mlp", {"layers": 2, "hidden": 64})
    prof = profile_model(spec, 4, "cpu", warmup=1, repeats=2)
    assert prof.copy_ms_per_byte is not None and prof.copy_ms_per_byte > 0
    assert prof.optimizer_ms_per_byte["adam"] > 0
    assert Profile.from_json(json.loads(json.dumps(prof.to_json()))).copy_ms_per_byte == prof.copy_ms_per_byte
    alone = profile_model(spec, 4, "cpu", warmup=0, repeats=1, optimizer=None)
    assert alone.copy_ms_per_byte is None and "copy_ms_per_byte" not in alone.to_json()


class _Float32Inside(torch.nn.Module):
    """A float32 layer inside a float64 model: casts its input, returns float64 (a mixed-precision block)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x.float())).double()


def test_a_layer_of_its_own_dtype_is_profiled_in_it() -> None:
    """Without --dtype every layer keeps its own dtype, in the profile as in training (a stage casts nothing but the
    first stage's inputs). Before, the profiler's memory probe cast every layer to the first one's dtype, and the
    float32 layer failed ("mat1 and mat2 must have the same dtype"): planning on the spot stopped the run."""
    data = torch.utils.data.TensorDataset(torch.randn(8, 4, dtype=torch.float64), torch.zeros(8, dtype=torch.long))
    layers = [torch.nn.Linear(4, 4).double(), _Float32Inside(), torch.nn.Linear(4, 2).double()]
    prof = profile_model(ModelSpec(layers, torch.nn.functional.cross_entropy, data, name="mixed"), 2, "cpu",
                         warmup=0, repeats=1)
    assert len(prof.layers) == 3 and layers[1].fc.weight.dtype == torch.float32
    assert prof.layers[1].parameter_bytes == (4 * 4 + 4) * 4  # counted in its own dtype (float32)


def test_rounds_keep_each_layer_s_fastest_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """--rounds with the idle timing (CPU's): every layer timed that many times in turn, each keeping the round
    with its least forward + backward. Without --rounds on CPU, one round. A host's slow spell that lasts a
    whole round (seconds) then prices no layer."""
    import partitioner.profiler as profiler

    real = profiler.profile_layer
    calls: list[int] = []
    # per round, per layer: forward and backward ms; layer 0 fastest in round 1, layer 1 in round 2
    drawn = [[(3.0, 6.0), (1.0, 2.0)], [(1.0, 2.0), (5.0, 9.0)], [(2.0, 4.0), (1.5, 1.0)]]

    def fake(layer: Any, x: Any, **kw: Any) -> tuple[dict[str, Any], Any]:
        stats, out = real(layer, x, **kw)
        fwd, bwd = drawn[len(calls) // 2][len(calls) % 2]
        calls.append(1)
        return {**stats, "forward_ms": fwd, "backward_ms": bwd}, out

    monkeypatch.setattr(profiler, "profile_layer", fake)
    monkeypatch.setattr(profiler, "ROUND_GAP_S", 0.0)
    spec = build_model("mlp", {"layers": 2, "hidden": 8})
    prof = profile_model(spec, 2, "cpu", warmup=0, repeats=1, rounds=3, optimizer=None)
    assert len(calls) == 6
    assert [(lay.forward_ms, lay.backward_ms) for lay in prof.layers] == [(1.0, 2.0), (1.5, 1.0)]
    assert [lay.name.split(":")[0] for lay in prof.layers] == ["0", "1"]
    calls.clear()
    one = profile_model(spec, 2, "cpu", warmup=0, repeats=1, optimizer=None)
    assert len(calls) == 2 and [(lay.forward_ms, lay.backward_ms) for lay in one.layers] == [(3.0, 6.0), (1.0, 2.0)]
