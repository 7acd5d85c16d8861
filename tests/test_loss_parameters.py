"""A loss with parameters is refused where the model is built: no stage holds the loss's parameters, so no
optimizer would ever update them, and the run would train without them silently."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeflow.spec import ModelError, ModelSpec, build_model


class ScaledLoss(nn.Module):
    """Cross-entropy of learned-temperature logits: a loss with a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out / self.temperature, target)


def learned_loss() -> ModelSpec:
    return ModelSpec(layers=[nn.Linear(4, 3)], loss_fn=ScaledLoss(), dataset=[])  # type: ignore[arg-type]


MESSAGE = ("the loss ScaledLoss has parameters (temperature), which pipeflow would never train: only the layers' "
           "parameters are; expected a loss without parameters, so move them into the last layer")


def test_a_loss_with_parameters_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as e:
        learned_loss()
    assert str(e.value) == MESSAGE
    with pytest.raises(ModelError) as e:
        build_model("tests.test_loss_parameters:learned_loss", {})
    assert MESSAGE in str(e.value) and "\n" not in str(e.value)


def test_a_loss_module_without_parameters_is_a_loss() -> None:
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 1.0]))  # a buffer, not a parameter
    spec = ModelSpec(layers=[nn.Linear(4, 3)], loss_fn=weighted, dataset=[])  # type: ignore[arg-type]
    assert spec.loss_fn is weighted
