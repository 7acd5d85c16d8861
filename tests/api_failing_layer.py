"""A user's loop over Pipeline.step (tests/test_api.py) whose last layer's first backward raises on its rank alone,
as a layer's own bug, an autograd error or an out-of-memory does: run as
`mpirun -np 2 python -m tests.api_failing_layer`. The other rank is then waiting for that rank's messages."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from tests.api_user_loop import batches, model


def _raise(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the layer's own bug")


class Fails(nn.Module):
    """The wrapped layer, whose backward raises at its `at`-th microbatch."""

    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.inner(x)
        if self.calls == self.at:
            y.register_hook(_raise)  # in its backward
        return y


def main() -> int:
    import pipeflow

    layers = model()
    layers[-1] = Fails(layers[-1], at=1)  # the first backward, before any gradient went back
    with pipeflow.Pipeline(layers, F.cross_entropy, schedule="1f1b", microbatches=4, device="cpu",
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)) as pipe:
        for x, y in batches():
            pipe.step(x, target=y)
    return 0


if __name__ == "__main__":
    sys.exit(main())
