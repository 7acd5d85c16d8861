"""The runtime's seams of issue 12, read from the source with `ast` and checked on the objects: the engine takes
its hooks (hooks.py Protocols) through its constructor and no module assigns an engine's attributes; the
torch-private flag of the device-side skip is read in one place; the runtime reads a validated TrainConfig,
never an argparse Namespace."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from pipeflow import hooks
from pipeflow.config import MICROBATCH_SIZE, ConfigError, TrainConfig
from pipeflow.engine import Engine
from pipeflow.train import build_parser, check_args

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = sorted((ROOT / "pipeflow").rglob("*.py"))


def test_the_engine_takes_its_hooks_through_keyword_parameters():
    params = inspect.signature(Engine.__init__).parameters
    for name in ("timer", "step_gate", "loader"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["timer"].default is None and params["step_gate"].default is None


def test_no_module_assigns_an_engine_attribute_or_reads_the_private_torch_flag():
    """`engine.step_guard = ...` (supervisor) and `optimizer.found_inf = ...` (guard) were patches from outside."""
    offenders = []
    for path in RUNTIME:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and (
                        (isinstance(t.value, ast.Name) and t.value.id == "engine")
                        or (isinstance(t.value, ast.Attribute) and t.value.attr == "engine")):
                    offenders.append(f"{path.name}:{node.lineno} assigns engine.{t.attr}")
                if isinstance(t, ast.Attribute) and t.attr == "found_inf" and path.name != "hooks.py":
                    offenders.append(f"{path.name}:{node.lineno} sets found_inf")
        if "_step_supports_amp_scaling" in path.read_text() and path.name != "hooks.py":
            offenders.append(f"{path.name} reads torch's _step_supports_amp_scaling")
    assert not offenders, offenders


def test_the_hook_implementations_satisfy_the_protocols():
    from pipeflow.api import BatchFeed
    from pipeflow.data.loader import MicrobatchLoader
    from pipeflow.guard import StepGuard
    from pipeflow.spans import SpanTimer
    from pipeflow.stash import StashPolicy

    assert isinstance(SpanTimer(torch.device("cpu")), hooks.Timing) and isinstance(hooks.Timer(), hooks.Timing)
    assert not issubclass(SpanTimer, hooks.Timer)  # structural: the monitor no longer subclasses the engine's
    assert isinstance(hooks.WeightPolicy(), hooks.WeightHooks) and issubclass(StashPolicy, hooks.WeightPolicy)
    assert callable(StepGuard) and "__call__" in vars(StepGuard)  # a StepGate
    assert isinstance(BatchFeed(2), hooks.Feed)
    assert isinstance(MicrobatchLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1)), 2), hooks.Feed)


def test_device_skip_is_armed_through_the_hooks_module():
    w = torch.nn.Parameter(torch.ones(2))
    fused = torch.optim.Adam([w], lr=0.1, fused=True)
    assert hooks.supports_device_skip(fused) and not hooks.supports_device_skip(torch.optim.SGD([w], lr=0.1))
    w.grad = torch.ones(2)
    hooks.arm_device_skip(fused, torch.ones(()))
    fused.step()
    assert torch.equal(w.detach(), torch.ones(2))  # skipped on the device
    hooks.arm_device_skip(fused, torch.zeros(()))
    fused.step()
    assert not torch.equal(w.detach(), torch.ones(2))


def test_the_runtime_reads_a_frozen_validated_config_not_a_namespace():
    for path in RUNTIME:
        if path.name != "train.py":  # the command line is parsed there, into a TrainConfig
            text = path.read_text()
            assert "Namespace" not in text and "import argparse" not in text, path.name
    cfg = check_args(build_parser().parse_args(["--steps", "3", "--schedule", "gpipe"]))
    assert isinstance(cfg, TrainConfig) and (cfg.steps, cfg.schedule, cfg.microbatch_size) == (3, "gpipe", 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 4  # type: ignore[misc]
    # Every flag is a field, with the flag's default (--microbatch-size's when not given: --global-batch leaves it to
    # the planner, TrainConfig.from_flags).
    defaults = vars(build_parser().parse_args([]))
    assert {f.name for f in dataclasses.fields(TrainConfig)} == set(defaults)
    assert dataclasses.asdict(TrainConfig()) == {**defaults, "microbatch_size": MICROBATCH_SIZE}
    with pytest.raises(ConfigError, match=r"^--checkpoint-every needs --checkpoint-dir \(where to write"):
        TrainConfig(checkpoint_every=2)
    assert TrainConfig(checkpoint_dir="ck", checkpoint_every=5, steps=3).segment_steps == 3
    assert TrainConfig(steps=3).segment_steps is None
