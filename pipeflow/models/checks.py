"""The built-in builders' argument checks: a ValueError of one line naming the argument, what it must be and what
was found (--model-args is JSON: a size of 0 builds empty layers, "x" is a true tie, 2.5 heads divide nothing)."""
from __future__ import annotations

from typing import Any


def check_sizes(model: str, least: int = 1, **sizes: Any) -> None:
    """Each of `sizes` an integer >= `least` (a JSON true or false is not one)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{model} needs {name} >= {least} (an integer), found {value!r}")


def check_flags(model: str, **flags: Any) -> None:
    """Each of `flags` true or false."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{model} needs {name} to be true or false, found {value!r}")
