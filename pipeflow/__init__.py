"""pipeflow: pipeline-parallel training for PyTorch."""
from pipeflow.spec import ModelSpec, build_model

__all__ = ["ModelSpec", "build_model"]
__version__ = "0.1.0"
