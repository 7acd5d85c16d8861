"""An MLP whose layers pass a tuple (hidden, residual) along: the tuple case of the layer contract."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from pipeflow.models.checks import check_sizes
from pipeflow.spec import ModelSpec


class InputLayer(nn.Module):
    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return torch.relu(h), h


class HiddenLayer(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, r = xs
        return torch.relu(self.fc(h)), r + 0.5 * h


class OutputLayer(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, classes)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, r = xs
        return self.fc(h + r)


def build(layers: int = 6, d_in: int = 32, hidden: int = 64, classes: int = 10, samples: int = 2048,
          data_seed: int = 7) -> ModelSpec:
    """`layers` modules in all (input, layers-2 hidden, output); data from a fixed random teacher. The eval_dataset
    holds samples // 4 other inputs, drawn from their own seed (data_seed + 1), labelled by the same teacher."""
    check_sizes("mlp", 2, layers=layers)  # an input and an output layer
    check_sizes("mlp", d_in=d_in, hidden=hidden, classes=classes, samples=samples)
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randn(samples, d_in, generator=g)
    teacher = torch.randn(d_in, classes, generator=g)
    y = (x @ teacher).argmax(dim=1)
    x_eval = torch.randn(max(1, samples // 4), d_in, generator=torch.Generator().manual_seed(data_seed + 1))
    held_out = TensorDataset(x_eval, (x_eval @ teacher).argmax(dim=1))
    mods: list[nn.Module] = [InputLayer(d_in, hidden)]
    mods += [HiddenLayer(hidden) for _ in range(layers - 2)]
    mods.append(OutputLayer(hidden, classes))
    params = sum(p.numel() for m in mods for p in m.parameters())
    # 6 N per sample: 2 N forward, 4 N backward (the weight matmuls dominate; PaLM's estimate)
    return ModelSpec(layers=mods, loss_fn=F.cross_entropy, dataset=TensorDataset(x, y), flops_per_sample=6.0 * params,
                     eval_dataset=held_out)
