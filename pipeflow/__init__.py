"""pipeflow: pipeline-parallel training for PyTorch (`Pipeline`: the Python API, docs/api.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeflow.api import Pipeline
    from pipeflow.lrsched import LrSchedule
    from pipeflow.spec import ModelSpec, build_model

__all__ = ["LrSchedule", "ModelSpec", "Pipeline", "build_model"]
__version__ = "0.1.0"
_MODULES = {"ModelSpec": "spec", "build_model": "spec", "Pipeline": "api", "LrSchedule": "lrsched"}


def __getattr__(name: str) -> Any:
    # Lazy, so that the pure modules (pipeflow.schedule, used by pipeflow-plan) load without torch.
    if name in _MODULES:
        import importlib

        return getattr(importlib.import_module(f"pipeflow.{_MODULES[name]}"), name)
    raise AttributeError(f"module 'pipeflow' has no attribute {name!r}")
