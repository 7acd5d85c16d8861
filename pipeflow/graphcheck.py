"""What PIPEFLOW_CUDA_GRAPHS=1 can replay (pipeflow/graphs.py), checked before any work.

The knob, the device, the schedule, and layers without randomness."""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from partitioner.plan import Plan
from pipeflow.kinds import schedule_kind

_RANDOM = (nn.modules.dropout._DropoutNd, nn.RReLU)


def graphs_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """PIPEFLOW_CUDA_GRAPHS: 1 replays each stage's actions as CUDA graphs, 0 (the default) runs them eagerly."""
    text = environ.get("PIPEFLOW_CUDA_GRAPHS", "0")
    if text not in ("0", "1"):
        raise ValueError(f"PIPEFLOW_CUDA_GRAPHS must be 0 or 1, found {text!r}")
    return text == "1"


def random_layer(layers: list[nn.Module], start: int) -> str | None:
    """The first of `layers` (global indices from `start`) holding a module that draws random numbers in training,
    named with what it draws; None when none does."""
    for k, layer in enumerate(layers):
        for name, mod in layer.named_modules():
            p = getattr(mod, "p", 0.0) if isinstance(mod, _RANDOM) else getattr(mod, "dropout", 0.0)
            if isinstance(mod, nn.RReLU) or (isinstance(p, float) and p > 0):
                what = type(mod).__name__ + (f" {name}" if name else "")
                return f"layer {start + k} ({type(layer).__name__}): {what}" + (
                    "" if isinstance(mod, nn.RReLU) else f" with dropout {p}")
    return None


def check_graphs(layers: list[nn.Module], plan: Plan, device: str) -> None:
    """ValueError, one line, where PIPEFLOW_CUDA_GRAPHS=1 is set and cannot replay this plan's actions (module
    docstring); the same on every rank. `device`: --device (auto, cpu or cuda)."""
    if not graphs_enabled():
        return
    head = "PIPEFLOW_CUDA_GRAPHS=1"
    if device == "cpu" or not torch.cuda.is_available():
        raise ValueError(f"{head} replays CUDA graphs, but the ranks run on the CPU (--device {device}); unset it")
    kind = schedule_kind(plan.schedule)
    if not kind.flush or kind.split_backward or plan.virtual_stages > 1:
        v = plan.virtual_stages
        raise ValueError(f"{head} replays the actions of gpipe and 1f1b with one stage per rank, found --schedule "
                         f"{plan.schedule}" + (f" with {v} stages per rank" if v > 1 else ""))
    found = random_layer(layers, 0)
    if found is not None:
        raise ValueError(f"{head} needs layers without randomness (a replay cannot seed each microbatch); {found}")
