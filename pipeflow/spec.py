"""The model contract: a layer list, a loss and a dataset (README, Commands)."""
from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class ModelSpec:
    """What a model builder returns. Layer i's output is layer i+1's input."""

    layers: list[nn.Module]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    dataset: torch.utils.data.Dataset
    # Tokens per sample, for tokens/s in the monitor; 0 when the model has no tokens.
    tokens_per_sample: int = 0
    name: str = ""
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("ModelSpec.layers is empty: a model needs at least one layer")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"ModelSpec.layers[{i}] is {type(layer).__name__}, expected an nn.Module")


BUILTIN_MODELS = {
    "gpt": "pipeflow.models.gpt:build",
    "mlp": "pipeflow.models.mlp:build",
}


class ModelError(ValueError):
    """A --model or --model-args value that cannot be built."""


def parse_model_args(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelError(f"--model-args must be a JSON object, found {text!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise ModelError(f"--model-args must be a JSON object, found {type(value).__name__}: {text!r}")
    return value


def resolve_builder(model: str) -> Callable[..., ModelSpec]:
    """`gpt` / `mlp` or `package.module:function`."""
    target = BUILTIN_MODELS.get(model, model)
    if ":" not in target:
        raise ModelError(
            f"unknown model {model!r}: expected one of {sorted(BUILTIN_MODELS)} or 'package.module:function'")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelError(f"cannot import model module {module_name!r} for --model {model!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelError(f"module {module_name!r} has no callable {attr!r} (from --model {model!r})")
    return fn


def build_model(model: str, model_args: dict[str, Any] | None = None, *, seed: int = 0) -> ModelSpec:
    """Seed, then build: every rank gets the weights a single process would (docs/reproducibility.md)."""
    builder = resolve_builder(model)
    torch.manual_seed(seed)
    try:
        spec = builder(**(model_args or {}))
    except TypeError as e:
        raise ModelError(f"--model-args {json.dumps(model_args or {})} do not fit model {model!r}: {e}") from None
    except (ValueError, RuntimeError, OverflowError, MemoryError) as e:  # e.g. a negative or huge size
        raise ModelError(f"model {model!r} cannot be built with --model-args {json.dumps(model_args or {})}: "
                         f"{type(e).__name__}: {e}") from None
    if not isinstance(spec, ModelSpec):
        raise ModelError(f"model builder {model!r} returned {type(spec).__name__}, expected pipeflow.ModelSpec")
    spec.name = spec.name or model
    spec.args = dict(model_args or {})
    return spec
