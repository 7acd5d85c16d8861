"""Parameters shared by several layers (a tied embedding and head, a block repeated in the layer list): the
profile's optional `ties` and what they change in a plan's price.

Each layer's `parameter_bytes` counts every parameter it holds, a shared one too. `ties` lists each set of layers
that share parameters, with the bytes they share: [{"layers": [0, 25], "bytes": 262144000}, ...] (parameters held
by the same layers summed; layers in order). A stage holds a shared parameter once however many of its layers
use it, so the bytes of stage [i, k) are its layers' sum less (n - 1) x bytes for every tie n of whose layers lie
in [i, k). Stages that hold the same parameter each keep a copy and sum its gradient at the STEP, over the ranks
of all of them (pipeflow/reduce.py, Tie); the asynchronous schedules cannot split one over stages at all
(ScheduleKind.ties_allowed): their stages would train different weight versions of one parameter.

A format module (no numpy, no torch: pipeflow-plan reads profiles without them); the planner's arrays of the same
ties are partitioner.layercosts.Ties.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def find_ties(layers: Sequence[Any], dtype: Any = None) -> list[dict[str, Any]]:
    """The layers sharing trainable parameters (by identity, as the runtime finds them), in order of first use.
    `dtype`: the torch dtype the layers' floating-point parameters are cast to (--dtype; None: as built)."""
    held: dict[int, tuple[list[int], int]] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():  # once per layer, however many of its modules hold it
            if not p.requires_grad:  # frozen: in each layer's frozen_bytes, no gradient to sum
                continue
            size = p.numel() * (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())
            uses, size = held.setdefault(id(p), ([], size))
            uses.append(i)
    out: dict[tuple[int, ...], int] = {}
    for uses, size in held.values():
        if len(uses) > 1:
            out[tuple(uses)] = out.get(tuple(uses), 0) + size
    return [{"layers": list(k), "bytes": v} for k, v in out.items()]


def tie_problem(ties: Any, parameter_bytes: Sequence[float], max_bytes: float) -> str | None:
    """What is wrong with a profile's `ties` (None: nothing), given its layers' parameter_bytes."""
    if not isinstance(ties, list):
        return f"ties must be a list, found {type(ties).__name__}"
    n = len(parameter_bytes)
    for k, tie in enumerate(ties):
        if not isinstance(tie, dict) or set(tie) != {"layers", "bytes"}:
            return f"ties[{k}] must be an object with exactly the keys layers and bytes"
        layers, size = tie["layers"], tie["bytes"]
        if (not isinstance(layers, list) or len(layers) < 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in layers)
                or layers != sorted(set(layers))):
            return f"ties[{k}].layers must be at least two increasing layer indices in [0, {n}), found {layers!r}"
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 <= size <= max_bytes:
            return f"ties[{k}].bytes must be a number of bytes in [0, {max_bytes:g}], found {size!r}"
        over = next((x for x in layers if size > parameter_bytes[x]), None)
        if over is not None:
            return (f"ties[{k}].bytes ({size}) must be at most the parameter_bytes of each of its layers, found layer "
                    f"{over}'s {parameter_bytes[over]:g}")
    return None


def split_tie_error(layers: Sequence[int], stages: Sequence[int], schedule: str) -> str:
    """One line: a plan whose stages `stages` split the tie over `layers`, which `schedule` cannot train."""
    return (f"layers {', '.join(map(str, layers))} share parameters and the plan puts them on stages "
            f"{', '.join(map(str, stages))}, which --schedule {schedule} cannot train (its stages would use different "
            "weight versions of one parameter): keep those layers on one stage, or use --schedule gpipe or 1f1b")
