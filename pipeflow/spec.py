"""The model contract: a layer list, a loss and a dataset (README, Commands)."""
from __future__ import annotations

import importlib
import inspect
import json
import sys
import traceback
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
    # Training FLOPs (forward and backward) per sample, for model FLOPs utilisation (mfu.py); None: not known,
    # no MFU reported.
    flops_per_sample: float | None = None
    name: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    # Held-out samples for pipeflow-train --eval-every (read in order, never shuffled); None: the model has none.
    eval_dataset: torch.utils.data.Dataset | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("ModelSpec.layers is empty: a model needs at least one layer")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"ModelSpec.layers[{i}] is {type(layer).__name__}, expected an nn.Module")
            lazy = uninitialized(layer)
            if lazy:  # torch pipelining and DeepSpeed need them materialized too: shapes decide splits and buffers
                raise ValueError(f"ModelSpec.layers[{i}] ({type(layer).__name__}) has an uninitialized parameter "
                                 f"{lazy!r} (a lazy module such as nn.LazyLinear), but pipeflow needs every "
                                 "parameter's shape at set-up, to profile, plan and replicate the layers: run one "
                                 "forward on a sample before building the ModelSpec (nn.Sequential(*layers)(x)), or "
                                 "give the layer its input size (nn.Linear(in_features, ...))")
        if isinstance(self.loss_fn, nn.Module):
            names = [n for n, _ in self.loss_fn.named_parameters()]
            if names:  # no stage holds them: no optimizer would ever update them
                raise ValueError(f"the loss {type(self.loss_fn).__name__} has parameters ({', '.join(names[:3])}), "
                                 f"which pipeflow would never train: only the layers' parameters are; expected a "
                                 f"loss without parameters, so move them into the last layer")


def uninitialized(layer: nn.Module) -> str | None:
    """The name of the layer's first parameter or buffer a lazy module has not materialized yet, or None."""
    named = [*layer.named_parameters(), *layer.named_buffers()]
    return next((n for n, t in named if nn.parameter.is_lazy(t)), None)


def model_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of the first floating-point parameter: what a model built without --dtype computes in
    (docs/reproducibility.md); None when it has none."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


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
    """`gpt` / `mlp` or `package.module:function`.

    Importing the module and calling the function runs its code, as torch.load without weights_only
    does: that is what a `module:function` interface means. What is refused is what cannot be a model
    builder and is the classic way to run a command: anything but a Python function (`def`): builtins
    such as os:system, classes, callable objects; and any function of Python's standard library
    (os:popen, subprocess:run, shutil:rmtree), also when another module re-exports it.
    """
    target = BUILTIN_MODELS.get(model, model)
    if ":" not in target:
        raise ModelError(
            f"unknown model {model!r}: expected one of {sorted(BUILTIN_MODELS)} or 'package.module:function'")
    module_name, _, attr = target.partition(":")
    if _stdlib(module_name):  # refused before importing it
        raise ModelError(f"--model {model!r} names Python's standard library, which has no model builder: "
                         "expected 'package.module:function' of your own code returning a pipeflow.ModelSpec")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelError(f"cannot import model module {module_name!r} for --model {model!r}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ModelError(f"module {module_name!r} has no {attr!r} (from --model {model!r})")
    if not inspect.isfunction(fn) or _stdlib(fn.__module__):
        what = (f"a function of Python's standard library ({fn.__module__})" if inspect.isfunction(fn)
                else "a class" if inspect.isclass(fn) else f"a {type(fn).__name__}, not a Python function")
        raise ModelError(f"--model {model!r} is {what}: expected a Python function (def) of your own code that "
                         "returns a pipeflow.ModelSpec")
    return fn


def _stdlib(module: str | None) -> bool:
    top = (module or "").split(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names


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
    except Exception as e:  # noqa: BLE001 (the builder's own bug, a ZeroDivisionError say: one line, and where)
        frame = traceback.extract_tb(e.__traceback__)[-1]
        raise ModelError(f"model {model!r} failed to build with --model-args {json.dumps(model_args or {})}: "
                         f"{type(e).__name__}: {e} (at {frame.filename}:{frame.lineno})") from None
    if not isinstance(spec, ModelSpec):
        raise ModelError(f"model builder {model!r} returned {type(spec).__name__}, expected pipeflow.ModelSpec")
    spec.name = spec.name or model
    spec.args = dict(model_args or {})
    _check_samples(spec.dataset, model)
    if spec.eval_dataset is not None:
        _check_samples(spec.eval_dataset, model, "eval_dataset")
    return spec


def _check_samples(dataset: Any, model: str, what: str = "dataset") -> None:
    """The dataset's first sample is an (input, target) pair the loader can batch: else one line at set-up, where
    the loader would stop the first stage mid-run with a TypeError's traceback (a dict sample, as many datasets
    give)."""
    from pipeflow.data.loader import collate

    if len(dataset) == 0:
        if what == "dataset":  # an empty eval_dataset matters only to --eval-every (evalflags.check_dataset)
            raise ModelError(f"model {model!r}: its dataset is empty; expected at least one (input, target) sample")
        return
    try:
        sample = dataset[0]
    except Exception as e:  # noqa: BLE001 (the user's __getitem__: whatever it raises, one line)
        raise ModelError(f"model {model!r}: its {what}'s sample 0 cannot be read: {type(e).__name__}: {e}") from None
    expected = (f"model {model!r}: its {what}'s samples must be (input, target) pairs, each a tensor, a number, or a "
                "tuple or dict of them")
    try:
        batched = collate([sample])  # a tuple per part of a tuple or list sample
    except TypeError as e:
        raise ModelError(f"{expected}; sample 0: {e}") from None
    if not (isinstance(batched, tuple) and len(batched) == 2):
        found = (f"has {len(batched)} parts" if isinstance(batched, tuple) else f"is a {type(sample).__name__}"
                 + (" (return (inputs, target) from __getitem__; inputs may be a dict)" if isinstance(sample, dict)
                    else ""))
        raise ModelError(f"{expected}; sample 0 {found}")
