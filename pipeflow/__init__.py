"""pipeflow: pipeline-parallel training for PyTorch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeflow.spec import ModelSpec, build_model

__all__ = ["ModelSpec", "build_model"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that the pure modules (pipeflow.schedule, used by pipeflow-plan) load without torch.
    if name in __all__:
        from pipeflow import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'pipeflow' has no attribute {name!r}")
