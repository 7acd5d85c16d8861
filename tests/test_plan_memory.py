"""The planner's memory against what a stage holds, for a model unlike gpt and mlp (tests.models.memory_mlp): frozen
parameters take no gradient and no optimizer state; buffers are held once, not once per microbatch; a stage holds
its received input and its sent output for every microbatch in flight (pipeflow/stage.py: Stage.saved) beyond what
its end layers' backward keeps. The DP (CostModel.memory_bytes) and the simulator price each the same."""
from __future__ import annotations

import numpy as np
import pytest

from partitioner.costmodel import OPTIMIZER_STATES, CostModel
from partitioner.plan import Plan, StagePlan
from partitioner.profile import LayerProfile, Profile, ProfileError
from partitioner.profiler import profile_model
from partitioner.service import evaluate_plan, layer_costs, plan_detailed
from partitioner.topology import Topology
from tests.models import memory_mlp

D, K = 16, 64
LINEAR = (D * D + D) * 4
WIDE = 4 * D * K * 4  # Repeat's output at microbatch 4, float32


@pytest.fixture(scope="module")
def prof() -> Profile:
    return profile_model(memory_mlp(d=D, k=K), 4, repeats=1, warmup=0)


def test_the_profile_measures_what_a_stage_holds_besides_activations(prof: Profile) -> None:
    frozen, trainable, wide, back, project, head = prof.layers
    assert (frozen.parameter_bytes, frozen.frozen_bytes, trainable.frozen_bytes) == (LINEAR, LINEAR, 0)
    assert (wide.output_bytes, wide.activation_bytes) == (WIDE, 0)
    assert (wide.saved_output_bytes, back.saved_input_bytes) == (0, 0)
    assert project.buffer_bytes == D * D * 4
    assert project.activation_bytes < D * D * 4  # the buffer its x @ proj keeps is not an activation
    assert trainable.saved_input_bytes == frozen.output_bytes  # a Linear keeps its input


def stage_memory(prof: Profile, ranges: list[tuple[int, int]], m: int, schedule: str = "gpipe") -> list[float]:
    plan = Plan(schedule, m, len(ranges), [StagePlan(r, 1, [k]) for k, r in enumerate(ranges)])
    return evaluate_plan(prof, plan).sim.peak_memory_bytes


def test_a_boundary_tensor_is_held_per_microbatch_in_flight(prof: Profile) -> None:
    """Cut after the wide layer: the first stage keeps the wide output it sent, the second the input it received,
    for each of the m microbatches gpipe holds; one microbatch more is one wide tensor more on each."""
    cut = [(0, 3), (3, 6)]
    two, three = stage_memory(prof, cut, 2), stage_memory(prof, cut, 3)
    act = [sum(x.activation_bytes for x in prof.layers[a:b]) for a, b in cut]
    loss = prof.loss_saved_bytes  # the last stage keeps each microbatch's loss graph until its backward, too
    assert loss and [b - a for a, b in zip(two, three)] == [act[0] + WIDE, act[1] + WIDE + loss]
    # cut after layer 1: its Tanh keeps the output the first stage sends (nothing added there), but the wide
    # layer keeps nothing of the input the second stage receives
    inside = [(0, 2), (2, 6)]
    assert [b - a for a, b in zip(stage_memory(prof, inside, 2), stage_memory(prof, inside, 3))] == [
        sum(x.activation_bytes for x in prof.layers[a:b]) + extra
        for (a, b), extra in zip(inside, [0, 4 * D * 4 + loss])]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_frozen_weights_take_no_gradient_nor_state_and_buffers_are_held_once(prof: Profile, optimizer: str) -> None:
    one = [(0, 6)]
    got = stage_memory(prof, one, 2)[0] - stage_memory(prof, one, 1)[0]  # one microbatch's activations
    held = stage_memory(prof, one, 1)[0] - got
    params = sum(x.parameter_bytes for x in prof.layers)
    trainable = params - LINEAR
    states = OPTIMIZER_STATES["adam"]
    loss = (prof.loss_bytes or 0.0) - (prof.loss_saved_bytes or 0.0)  # all of it but what a microbatch keeps
    assert held == pytest.approx(params + trainable * (1 + states) + D * D * 4 + loss)  # adam: the plan's optimizer
    # the same sum in the DP's memory, which the search checks --memory-per-worker with
    lay = layer_costs(prof, "gpipe", optimizer)
    model = CostModel(lay, Topology.parse("1x10GB/s", 1), "gpipe", 1, optimizer)
    want = evaluate_plan(prof, Plan("gpipe", 1, 1, [StagePlan((0, 6), 1, [0])]), optimizer=optimizer)
    assert float(model.memory_bytes(0, 6, 1, 1)) == pytest.approx(want.sim.peak_memory_bytes[0])


def test_a_frozen_backbone_fits_where_its_gradients_would_not() -> None:
    """Planning under a memory limit that frozen weights with Adam's state would exceed (it was refused)."""
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 1000, 1000, 10_000_000, frozen_bytes=10_000_000 if i < 3 else 0)
              for i in range(4)]
    prof = Profile("m", {}, "cpu", "float32", 4, layers)
    planned = plan_detailed(prof, 1, schedule="1f1b", microbatches=1, memory_per_worker=75_000_000)
    # the weights, the trainable layer's gradient and Adam's two states, one microbatch's activations
    assert planned.sim.peak_memory_bytes[0] == pytest.approx(4 * 10_000_000 + 3 * 10_000_000 + 4 * 1000, rel=1e-9)
    assert [c.parameter_bytes for c in planned.costs] == [10_000_000]  # all-reduced and updated: the trainable


@pytest.mark.parametrize("field, value, why", [
    ("frozen_bytes", 5, "layers[0].frozen_bytes must be at most its parameter_bytes (4), found 5"),
    ("saved_output_bytes", 101, "layers[0].saved_output_bytes must be at most its output_bytes (100), found 101"),
    ("buffer_bytes", -1, "layers[0].buffer_bytes must be a non-negative number, found -1"),
])
def test_bad_memory_fields_are_refused(field: str, value: int, why: str) -> None:
    with pytest.raises(ProfileError) as e:
        Profile("m", {}, "cpu", "float32", 4, [LayerProfile("l", 1.0, 1.0, 100, 10, 4, **{field: value})])
    assert str(e.value) == f"profile: {why}"


def test_an_old_profile_without_the_fields_is_priced_as_before(prof: Profile) -> None:
    old = Profile(prof.model, prof.model_args, "cpu", "float32", 4,
                  [LayerProfile(x.name, x.forward_ms, x.backward_ms, x.output_bytes, x.activation_bytes,
                                x.parameter_bytes) for x in prof.layers], loss_bytes=prof.loss_bytes)
    lay = layer_costs(old, "1f1b", "adam")
    assert lay.unsaved is None and lay.boundary_bytes(1, 3) == 0.0
    assert np.all(lay.frozen(0, np.arange(1, 7)) == 0) and np.all(lay.buffers(0, np.arange(1, 7)) == 0)


def test_gpipe_s_last_stage_keeps_every_microbatch_s_loss_graph(prof: Profile) -> None:
    """The loss's saved tensors (the GPT's fp32 log-softmax) stay until the microbatch's backward: under gpipe all m
    on the last stage (on one H200 the planner priced gpipe 4 x 16 of the 24-block GPT 4.3% low counting them once);
    under 1f1b the last stage holds one microbatch, and its price is as before."""
    assert 0 < prof.loss_saved_bytes <= prof.loss_bytes  # type: ignore[operator]
    one = [(0, 6)]
    gpipe = [b - a for a, b in zip(stage_memory(prof, one, 2), stage_memory(prof, one, 5))]
    assert gpipe == [3 * (sum(x.activation_bytes for x in prof.layers) + prof.loss_saved_bytes)]  # type: ignore[operator]
    assert stage_memory(prof, one, 5, "1f1b") == stage_memory(prof, one, 2, "1f1b")
