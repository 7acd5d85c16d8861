"""A minibatch's mean loss over the last stage's replicas (training's reports, Engine.take_loss, and evaluations)."""
from __future__ import annotations

from typing import Any

import torch

from pipeflow.comm import all_reduce


def mean_loss(losses: list[torch.Tensor], count: int, group: Any, device: torch.device, *, owner: bool
              ) -> float | None:
    """The mean of `count` microbatches' losses, `losses` this rank's of them, summed over the last stage's replicas
    (`group`; None: one replica), each holding its microbatches' losses: on the `owner` of the loss, None elsewhere.
    Collective over `group`; reads the device."""
    local = torch.stack(losses).sum() if losses else torch.zeros((), device=device)
    if group is not None:
        all_reduce(local, group)
    return float(local) / count if owner else None
