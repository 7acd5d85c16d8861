"""Built-in datasets and the deterministic sample order (DESIGN.md, Reproducibility)."""
from pipeflow.data.loader import MicrobatchLoader, collate
from pipeflow.data.text import StdlibText, SyntheticTokens

__all__ = ["MicrobatchLoader", "collate", "StdlibText", "SyntheticTokens"]
