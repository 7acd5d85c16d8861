"""A stage whose first layer changes its input in place (nn.ReLU(inplace=True), as in torchvision's VGG and ResNet)
trains as in one process, and the profiler times it (pipeflow/received.py). Before, the received activation was an
autograd leaf: "a leaf Variable that requires grad is being used in an in-place operation", a traceback from
pipeflow-train and from pipeflow-profile (and so from planning on the spot)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partitioner.profiler import profile_model
from pipeflow.received import received
from pipeflow.spec import build_model
from tests.conftest import Case, MpiRun, batched
from tests.reference import reference_delayed
from tests.test_seams_grads import SMALL, B, assert_same, reference, saved, train

MODEL = "tests.models_grads:inplace_relu"
OPT = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01"]


def test_the_alias_takes_an_in_place_change_and_passes_the_gradient_to_the_buffer() -> None:
    buf = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    twin = buf.detach().clone().requires_grad_(True)
    x = received(buf)
    assert not x.is_leaf and x.data_ptr() == buf.data_ptr()  # no copy
    weight = torch.randn(4, 3, dtype=torch.float64)
    (torch.relu_(x) @ weight).sum().backward()
    (torch.relu(twin) @ weight).sum().backward()
    assert torch.equal(buf.grad, twin.grad)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
        torch.relu_(torch.randn(2, requires_grad=True))  # what a stage's layers got before
    kept = received((torch.ones(2, requires_grad=True), torch.zeros(2, dtype=torch.long)))
    assert kept[0].grad_fn is not None and kept[1].grad_fn is None and kept[1].dtype == torch.long


def test_a_saved_tensor_changed_in_place_is_still_caught() -> None:
    buf = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x = received(buf)
    y = x @ torch.randn(4, 3, dtype=torch.float64, requires_grad=True)  # saves x for the weight's gradient
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("timing", ["idle", "stage"])
def test_the_profiler_times_layers_that_change_their_input_in_place(timing: str) -> None:
    prof = profile_model(build_model(MODEL, SMALL), 4, "cpu", warmup=0, repeats=1, timing=timing)
    assert [lay.name for lay in prof.layers] == ["0:Linear", "1:ReLU", "2:Linear", "3:ReLU", "4:Out"]
    assert all(lay.forward_ms >= 0 and lay.backward_ms >= 0 for lay in prof.layers)


def at_a_relu(d: Path, schedule: str) -> Case:
    return train(d, MODEL, SMALL, [(1, 1), (2, 2), (2, 1)], schedule=schedule, m=4, steps=3, extra=OPT)


@pytest.mark.parametrize("schedule", ["1f1b", "async"])
@batched(at_a_relu)
def test_stages_that_start_at_an_in_place_relu_equal_one_process(mpi: MpiRun, schedule: str) -> None:
    if schedule == "1f1b":
        want = reference(MODEL, SMALL, steps=3, microbatches=4, optimizer="adamw", lr=0.01, weight_decay=0.01)
    else:
        want = reference_delayed(MODEL, SMALL, schedule="async", stages=[(1, 1), (2, 2), (2, 1)], steps=3,
                                 microbatches=4, microbatch_size=B, optimizer="adamw", lr=0.01)
    assert_same(saved(mpi), want)
