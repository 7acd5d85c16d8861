"""Lazy modules (nn.LazyLinear) whose parameters are still uninitialized are refused where every path meets the
model, ModelSpec (pipeflow/spec.py): one line naming the layer and the parameter, exit 2 from the console scripts,
where the profiler and a replicated stage's gradient buckets stopped with a traceback (as torch pipelining and
DeepSpeed, pipeflow needs materialized parameters)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner.profiler import main as profile_main
from pipeflow import Pipeline
from pipeflow.spec import ModelError, ModelSpec, build_model
from tests.conftest import Case, MpiRun, batched, write_plan

MESSAGE = ("ModelSpec.layers[2] (LazyLinear) has an uninitialized parameter 'weight' (a lazy module such as "
           "nn.LazyLinear), but pipeflow needs every parameter's shape at set-up, to profile, plan and replicate the "
           "layers: run one forward on a sample before building the ModelSpec (nn.Sequential(*layers)(x)), or give "
           "the layer its input size (nn.Linear(in_features, ...))")


def layers() -> list[nn.Module]:
    return [nn.Linear(4, 6), nn.ReLU(), nn.LazyLinear(3)]


def test_uninitialized_parameters_are_refused_where_the_model_is_given() -> None:
    with pytest.raises(ValueError) as e:
        ModelSpec(layers(), nn.functional.cross_entropy, dataset=[])  # type: ignore[arg-type]
    assert str(e.value) == MESSAGE
    nested = [nn.Linear(4, 4), nn.Sequential(nn.LazyBatchNorm1d())]
    with pytest.raises(ValueError, match=r"layers\[1\] \(Sequential\) has an uninitialized parameter '0.weight'"):
        ModelSpec(nested, nn.functional.cross_entropy, dataset=[])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="uninitialized parameter 'weight'"):  # the Python API: before any process
        Pipeline(layers(), nn.functional.cross_entropy, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ModelError) as e:
        build_model("tests.models:lazy_mlp")
    assert "ModelSpec.layers[0] (LazyLinear) has an uninitialized parameter 'weight'" in str(e.value)
    assert "\n" not in str(e.value)


def test_lazy_layers_run_once_are_a_model() -> None:
    model = layers()
    nn.Sequential(*model)(torch.randn(2, 4))  # materialized
    spec = ModelSpec(model, nn.functional.cross_entropy, dataset=[])  # type: ignore[arg-type]
    assert spec.layers[2].weight.shape == (3, 6)


def test_pipeflow_profile_refuses_them_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile.json"
    assert profile_main(["--model", "tests.models:lazy_mlp", "--microbatch-size", "2", "--device", "cpu",
                         "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pipeflow-profile: error: ") and "\n" not in err and "uninitialized parameter" in err
    assert not out.exists()


def lazy_replicated(d: Path) -> Case:
    plan = d / "plan.json"
    np_ = write_plan(plan, "1f1b", 4, [(3, 2)])
    return Case(np_, ["--model", "tests.models:lazy_mlp", "--plan", str(plan), "--steps", "1", "--device", "cpu"],
                check=False)


@batched(lazy_replicated)
def test_pipeflow_train_refuses_them_in_one_line_at_set_up(mpi: MpiRun) -> None:
    assert mpi.proc.returncode == 2
    errors = [ln for ln in mpi.proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "uninitialized parameter 'weight'" in errors[0], mpi.proc.stderr
    assert "Traceback" not in mpi.proc.stderr
