"""Built-in datasets and the deterministic sample order (docs/reproducibility.md)."""
from pipeflow.data.loader import MicrobatchLoader, collate
from pipeflow.data.text import StdlibText, SyntheticTokens

__all__ = ["MicrobatchLoader", "collate", "StdlibText", "SyntheticTokens"]
