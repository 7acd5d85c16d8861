"""PIPEFLOW_CUDA_GRAPHS=1 (pipeflow/graphs.py): what it refuses, on any host; on a GPU, a pipeline of graphed stages
trains to the same weights, buffers and losses as eager stages, and a step unlike the first stops with one line."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partitioner.plan import even_plan
from pipeflow import config
from pipeflow.failure import UsageError
from pipeflow.graphcheck import check_graphs, random_layer
from pipeflow.graphs import CaptureAtStep, GraphedStage, weight_hooks
from pipeflow.stage import Stage, mark_requires_grad

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def layers(p: float = 0.0) -> list[nn.Module]:
    return [nn.Sequential(nn.Embedding(16, 8), nn.Flatten()),
            nn.Sequential(nn.Linear(32, 24), nn.BatchNorm1d(24), nn.GELU()),
            nn.Sequential(nn.LayerNorm(24), nn.Dropout(p), nn.Linear(24, 24), nn.Tanh()),
            nn.Linear(24, 5)]


@pytest.mark.parametrize(("case", "message"), [
    ("cpu", "PIPEFLOW_CUDA_GRAPHS=1 replays CUDA graphs, but the ranks run on the CPU (--device cpu); unset it"),
    ("async", "PIPEFLOW_CUDA_GRAPHS=1 replays the actions of gpipe and 1f1b with one stage per rank, found "
              "--schedule async"),
    ("zb", "PIPEFLOW_CUDA_GRAPHS=1 replays the actions of gpipe and 1f1b with one stage per rank, found --schedule zb"),
    ("interleaved", "PIPEFLOW_CUDA_GRAPHS=1 replays the actions of gpipe and 1f1b with one stage per rank, found "
                    "--schedule interleaved with 2 stages per rank"),
    ("dropout", "PIPEFLOW_CUDA_GRAPHS=1 needs layers without randomness (a replay cannot seed each microbatch); "
                "layer 2 (Sequential): Dropout 1 with dropout 0.1"),
])
def test_what_a_graph_cannot_replay_is_refused_in_one_line(monkeypatch, case, message):
    monkeypatch.setenv("PIPEFLOW_CUDA_GRAPHS", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: case != "cpu")
    model = layers(0.1 if case == "dropout" else 0.0)
    schedule = case if case in ("async", "zb", "interleaved") else "1f1b"
    plan = even_plan(len(model), 2, schedule=schedule, microbatches=4,
                     virtual_stages=2 if case == "interleaved" else 1)
    with pytest.raises(ValueError) as e:
        check_graphs(model, plan, "cpu" if case == "cpu" else "cuda")
    assert str(e.value) == message


def test_graphs_off_or_a_plan_they_can_replay_pass(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = even_plan(4, 2, schedule="async", microbatches=4)
    monkeypatch.delenv("PIPEFLOW_CUDA_GRAPHS", raising=False)
    check_graphs(layers(0.5), plan, "cpu")  # off: nothing checked
    monkeypatch.setenv("PIPEFLOW_CUDA_GRAPHS", "1")
    for schedule in ("gpipe", "1f1b"):
        check_graphs(layers(), even_plan(4, 2, schedule=schedule, microbatches=4), "cuda")
    assert random_layer(layers(), 0) is None and random_layer([nn.RReLU()], 3) == "layer 3 (RReLU): RReLU"


def test_the_knob_takes_0_or_1():
    config.check_environment({"PIPEFLOW_CUDA_GRAPHS": "0"})
    config.check_environment({"PIPEFLOW_CUDA_GRAPHS": "1"})
    with pytest.raises(config.ConfigError, match=r"^PIPEFLOW_CUDA_GRAPHS must be 0 or 1, found 'yes'$"):
        config.check_environment({"PIPEFLOW_CUDA_GRAPHS": "yes"})


def stub_cuda_graphs(monkeypatch) -> None:
    """CUDA's graph calls as no-ops, so that a CPU runs GraphedStage's host-side bookkeeping (a replay then runs
    nothing: what it returns is the capture's, not this step's)."""
    import contextlib

    class Graph:
        def capture_begin(self, pool=None, capture_error_mode="global"): pass
        def capture_end(self): pass
        def replay(self): pass

    class Stream:
        def __init__(self, *args, **kwargs): pass
        def wait_stream(self, other): pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)


def test_a_step_unlike_the_first_stops_with_one_usage_error(monkeypatch):
    """The checks of a replay, on the host: another shape, gradients where the first step had none, another order;
    each a UsageError of one line (pipeflow-train prints it and stops every rank with exit 2)."""
    stub_cuda_graphs(monkeypatch)
    stage = GraphedStage([nn.Linear(4, 4)], start=3, first=False, last=False, loss_fn=None,
                         device=torch.device("cpu"))

    def received(rows: int = 2) -> list[torch.Tensor]:
        return mark_requires_grad([torch.randn(rows, 4)], [True])

    for _ in range(2):
        for i in range(2):
            stage.forward(i, received())
        for i in range(2):
            stage.backward(i, [torch.ones(2, 4)])
    assert stage.captured and [(s.kind, s.mb) for s in stage.slots] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(UsageError) as e:
        stage.forward(0, received(3))
    assert str(e.value) == ("PIPEFLOW_CUDA_GRAPHS=1: layer 3 (Linear)'s F of microbatch 0 was given float32[3, 4] "
                            "requiring grad, but its graph was captured for float32[2, 4] requiring grad (the first "
                            "step's); graphs need every step's shapes alike: unset PIPEFLOW_CUDA_GRAPHS")
    stage.cursor = 2
    with pytest.raises(UsageError, match=r"^PIPEFLOW_CUDA_GRAPHS=1: layer 3 \(Linear\)'s B of microbatch 0 got "
                                         r"gradients where the first step got none, or the reverse$"):
        stage.backward(0, None)
    stage.cursor = 0
    with pytest.raises(UsageError, match=r"^PIPEFLOW_CUDA_GRAPHS=1: layer 3 \(Linear\) ran F of microbatch 1 where "
                                         r"its first step ran F of microbatch 0; graphs replay one order$"):
        stage.forward(1, received())


def test_the_second_step_begins_with_the_cache_released_then_every_action_captured(monkeypatch):
    """The engine's weight hooks under graphs (CaptureAtStep) capture when the second step's actions begin (nothing
    of it posted yet), after releasing what the eager step and then the warm-up left cached (else the graphs' pool,
    an eager step's peak, sits beside that cache: 2.7-3.0 GiB more than eager in use on 2 x H200 with the warm-up's
    kept). The
    first STEP captures nothing (a run of one step ends without a capture that could run out of memory after its
    last update), the second step replays, and later steps capture nothing. Eager stages keep the plain hooks."""
    stub_cuda_graphs(monkeypatch)
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda self, pool=None, capture_error_mode="global":
                        events.append("capture"))
    warm_up = GraphedStage._warm_up
    monkeypatch.setattr(GraphedStage, "_warm_up", lambda self: (events.append("warm-up"), warm_up(self)))
    stage = GraphedStage([nn.Linear(4, 4)], start=3, first=False, last=False, loss_fn=None,
                         device=torch.device("cpu"))
    hooks = weight_hooks({1: stage})
    assert isinstance(hooks, CaptureAtStep)
    assert not isinstance(weight_hooks({0: Stage([nn.Linear(4, 4)], start=0, first=True, last=False, loss_fn=None,
                                                 device=torch.device("cpu"))}), CaptureAtStep)
    hooks.begin_actions()
    for i in range(2):
        stage.forward(i, mark_requires_grad([torch.randn(2, 4)], [True]))
    for i in range(2):
        stage.backward(i, [torch.ones(2, 4)])
    hooks.after_step()
    assert not stage.captured and events == []
    hooks.begin_actions()
    captured = ["empty_cache", "warm-up", "empty_cache"] + ["capture"] * 4
    assert stage.captured and events == captured
    stage.forward(0, mark_requires_grad([torch.randn(2, 4)], [True]))
    hooks.begin_actions()
    assert events == captured


def test_the_engine_captures_as_its_second_step_begins(monkeypatch):
    """pipeflow-train's and Pipeline's engine under PIPEFLOW_CUDA_GRAPHS=1 (one stage in this process, CUDA's graph
    calls stubbed): its weight hooks are CaptureAtStep; the first step records, and the second step's actions begin
    with the cache released, the warm-up and every action captured, before the first forward they replay."""
    from mpi4py import MPI

    from partitioner.plan import Plan
    from pipeflow.comm import World
    from pipeflow.data.loader import MicrobatchLoader
    from pipeflow.engine import Engine
    from pipeflow.spec import build_model

    stub_cuda_graphs(monkeypatch)
    monkeypatch.setenv("PIPEFLOW_CUDA_GRAPHS", "1")
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda self, pool=None, capture_error_mode="global":
                        events.append("capture"))
    warm_up, forward = GraphedStage._warm_up, GraphedStage.forward
    monkeypatch.setattr(GraphedStage, "_warm_up", lambda self: (events.append("warm-up"), warm_up(self)))
    monkeypatch.setattr(GraphedStage, "forward", lambda self, mb, *a, **k: (events.append(f"F{mb}"),
                                                                           forward(self, mb, *a, **k))[1])
    plan = Plan.from_json({"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 2, "workers": 1,
                           "stages": [{"layers": [0, 3], "replicas": 1, "ranks": [0]}]})
    spec = build_model("mlp", {"layers": 3, "d_in": 4, "hidden": 8, "classes": 3, "samples": 64})
    loader = MicrobatchLoader(spec.dataset, 4, seed=0)
    loader.stage_on(torch.device("cpu"), 2)
    engine = Engine(World(0, 1, 0, torch.device("cpu"), "gloo", MPI.COMM_SELF), plan, spec, schedule="1f1b",
                    loader=loader, total_steps=2, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert isinstance(engine.policy, CaptureAtStep) and isinstance(engine.stage, GraphedStage)
    engine.train_step(0)
    assert events == ["F0", "F1"] and not engine.stage.captured
    engine.train_step(1)
    assert events == ["F0", "F1", "empty_cache", "warm-up", "empty_cache"] + ["capture"] * 4 + ["F0", "F1"]


def test_gradients_point_at_the_graphs_memory_after_each_backward(monkeypatch):
    """The bookkeeping of .grad, on the host: after the capture the parameters the update emptied hold nothing
    until a backward's replay, which points them at the memory the graphs write (the update sets them to None
    again); a parameter that kept its gradient (left out of the optimizer) keeps the same tensor, added into."""
    stub_cuda_graphs(monkeypatch)
    stage = GraphedStage([nn.Linear(4, 4), nn.Linear(4, 4)], start=0, first=False, last=False, loss_fn=None,
                         device=torch.device("cpu"))
    first, second = stage.module
    for i in range(2):
        stage.forward(i, mark_requires_grad([torch.randn(2, 4)], [True]))
    for i in range(2):
        stage.backward(i, [torch.ones(2, 4)])
    kept = second.weight.grad
    for p in (first.weight, first.bias, second.bias):  # the update's zero_grad(set_to_none=True) of the others
        p.grad = None
    stage.forward(0, mark_requires_grad([torch.randn(2, 4)], [True]))  # the second step: captured here
    assert stage.captured and first.weight.grad is None and second.weight.grad is kept
    pool = dict((id(p), g) for p, g in stage.grads)
    assert set(pool) == {id(p) for p in stage.parameters()} and pool[id(second.weight)] is kept
    stage.forward(1, mark_requires_grad([torch.randn(2, 4)], [True]))
    stage.backward(0, [torch.ones(2, 4)])
    assert all(p.grad is pool[id(p)] for p in stage.parameters())
    first.weight.grad = None  # the update again
    stage.backward(1, [torch.ones(2, 4)])
    assert first.weight.grad is pool[id(first.weight)]


class Branch(nn.Module):
    """Sends a dict: the trunk, a branch the next stage does not use (its gradient comes back None) and a float."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 24)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.lin(x)
        return {"h": torch.tanh(h), "unused": h * 2, "scale": 0.5}


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 24)

    def forward(self, d: dict) -> torch.Tensor:
        return self.lin(d["h"]) * d["scale"]


def branchy() -> list[nn.Module]:
    return [nn.Sequential(nn.Embedding(16, 8), nn.Flatten()), Branch(), Join(), nn.Linear(24, 5)]


def pipeline(graphed: bool, device: torch.device, left_out: int,
             model_fn=layers) -> tuple[list[Stage], torch.optim.Optimizer]:
    """Two stages of `model_fn()`; the optimizer leaves the last `left_out` parameters out (their gradients add up
    from step to step, as in one process)."""
    torch.manual_seed(0)
    model = model_fn()
    make = GraphedStage if graphed else Stage
    stages = [make(model[:2], start=0, first=True, last=False, loss_fn=None, device=device),
              make(model[2:], start=2, first=False, last=True, loss_fn=F.cross_entropy, device=device)]
    params = [p for s in stages for p in s.parameters()]
    return stages, torch.optim.Adam(params[:len(params) - left_out], lr=1e-2)


def train(graphed: bool, steps: int, m: int, order: list[str] | None = None, left_out: int = 0,
          model_fn=layers) -> tuple[list[torch.Tensor], list[float], bool]:
    """Two stages in one process, gpipe's order on stage 0 (every forward, then every backward: m microbatches in
    flight) and each microbatch's forward and backward together on stage 1; `order` swaps the backwards of the last
    step on stage 0 ("reversed")."""
    device = torch.device("cuda")
    (s0, s1), opt = pipeline(graphed, device, left_out, model_fn)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        if isinstance(s0, GraphedStage):  # as the engine's CaptureAtStep; stage 1 captures at its next forward
            s0.capture_recorded()
        x = torch.randint(0, 16, (m, 2, 4), generator=g).to(device)
        y = torch.randint(0, 5, (m, 2), generator=g).to(device)
        # As a rank sends them: what is sent keeps no autograd graph alive (a graph a step kept alive holds its
        # AccumulateGrad nodes on the eager stream, which a capture on its own stream cannot wait for).
        sent = {i: [t.detach() for t in s0.forward(i, x[i], global_mb=step * m + i)] for i in range(m)}
        grads = {}
        for i in range(m):
            recv = mark_requires_grad([t.detach().clone() for t in sent[i]], [True] * len(sent[i]))
            losses.append(float(s1.forward(i, recv, y[i], loss_scale=1 / m, tree=s0.trees.pop(i))[0]))
            grads[i] = [None if g is None else g.clone() for g in s1.backward(i, None)]
        backs = range(m - 1, -1, -1) if order and step == steps - 1 else range(m)
        for i in backs:
            s0.backward(i, grads[i])
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = [t.detach().clone() for s in (s0, s1) for t in [*s.module.parameters(), *s.module.buffers()]]
    state += [p.grad.clone() for s in (s0, s1) for p in s.module.parameters() if p.grad is not None]
    return state, losses, all(getattr(s, "captured", False) for s in (s0, s1))


@cuda
@pytest.mark.parametrize("left_out", [0, 2])
def test_graphed_stages_train_as_eager_ones(left_out):
    eager, graphed = train(False, 4, 3, left_out=left_out), train(True, 4, 3, left_out=left_out)
    assert graphed[2] and not eager[2]  # both stages replayed graphs from the second step
    assert graphed[1] == eager[1]
    assert len(eager[0]) == len(graphed[0]) and all(torch.equal(a, b) for a, b in zip(eager[0], graphed[0]))


def test_a_structured_message_and_a_gradient_left_none_keep_their_form_in_replays(monkeypatch):
    """On the host (CUDA's graph calls stubbed): a stage that sends a dict of two tensors and a float, and a next
    stage that leaves one tensor unused, are captured as the second step begins; the replays give back the dict's
    structure and a None gradient for the unused tensor, as the eager step did."""
    stub_cuda_graphs(monkeypatch)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    torch.manual_seed(0)
    model, cpu = branchy(), torch.device("cpu")
    s0 = GraphedStage(model[:2], start=0, first=True, last=False, loss_fn=None, device=cpu)
    s1 = GraphedStage(model[2:], start=2, first=False, last=True, loss_fn=F.cross_entropy, device=cpu)
    hooks = weight_hooks({0: s0, 1: s1})
    x, y = torch.randint(0, 16, (2, 4)), torch.randint(0, 5, (2,))
    trees = []
    for step in range(3):
        hooks.begin_actions()
        assert s0.captured == s1.captured == (step > 0)  # as the second step begins, before its first action
        out = s0.forward(0, x, global_mb=step)
        tree = s0.trees.pop(0)
        trees.append(tree)
        s1.forward(0, mark_requires_grad([t.detach().clone() for t in out], [True, True]), y, tree=tree)
        back = s1.backward(0, None)
        assert [type(t) for t in back] == [torch.Tensor, type(None)]  # "h" and "unused", in the dict's order
        s0.backward(0, back)
    assert trees[0] is not None and trees[1] == trees[2] == trees[0]  # the replays send the eager step's structure


@cuda
def test_structured_messages_and_an_output_the_next_stage_leaves_unused_train_as_eager():
    """Stage 0 sends a dict of two tensors and a float; stage 1 uses one tensor and the float, so the other's gradient
    comes back None: graphed, both stages train to the eager weights and losses."""
    eager, graphed = train(False, 4, 3, model_fn=branchy), train(True, 4, 3, model_fn=branchy)
    assert graphed[2] and not eager[2]
    assert graphed[1] == eager[1]
    assert len(eager[0]) == len(graphed[0]) and all(torch.equal(a, b) for a, b in zip(eager[0], graphed[0]))


@cuda
def test_a_step_out_of_the_first_steps_order_stops_with_one_line():
    with pytest.raises(UsageError, match=r"^PIPEFLOW_CUDA_GRAPHS=1: layers 0-1 ran B of microbatch 2 where its "
                                           r"first step ran B of microbatch 0; graphs replay one order$"):
        train(True, 3, 3, order=["reversed"])


def test_planning_on_the_spot_under_graphs_plans_what_they_replay(monkeypatch):
    """Without --schedule the planner picks among every flush schedule (zb and interleaved too); under
    PIPEFLOW_CUDA_GRAPHS=1 it plans 1f1b (not a plan the set-up would then refuse)."""
    from pipeflow.planning import make_plan
    from pipeflow.spec import build_model
    from pipeflow.train import build_parser
    from tests.test_global_batch import _OneHost

    spec = build_model("mlp", {"layers": 4, "hidden": 16, "samples": 64})
    args = build_parser().parse_args(["--model", "mlp", "--microbatches", "4", "--microbatch-size", "8"])
    monkeypatch.delenv("PIPEFLOW_CUDA_GRAPHS", raising=False)
    free = make_plan(args, spec, 2, 0, _OneHost())
    monkeypatch.setenv("PIPEFLOW_CUDA_GRAPHS", "1")
    graphed = make_plan(args, spec, 2, 0, _OneHost())
    tried = [c["schedule"] for c in free.extra["planner"]["schedule_auto"]["candidates"]]
    assert {"zb", "interleaved"} <= set(tried)
    assert graphed.schedule == "1f1b" and "schedule_auto" not in graphed.extra["planner"]


@cuda
def test_the_graphs_timing_prices_the_device_not_the_hosts_launches(monkeypatch):
    """A layer whose host takes 5 ms to issue a tiny kernel: timed as a stage runs it eagerly it costs the host's
    5 ms; timed as a graph replays it (--timing graphs, the default under PIPEFLOW_CUDA_GRAPHS=1) its kernel's."""
    from partitioner import profiler
    from tests.test_stage_timing import SleepLayer, _spec

    spec = _spec([SleepLayer(5.0, 0.0), SleepLayer(5.0, 0.0)])
    stage = profiler.profile_model(spec, 2, "cuda", warmup=2, repeats=3, optimizer=None, timing="stage")
    monkeypatch.setenv("PIPEFLOW_CUDA_GRAPHS", "1")
    graphs = profiler.profile_model(spec, 2, "cuda", warmup=2, repeats=3, optimizer=None)
    assert stage.timing == "stage" and graphs.timing == "graphs"
    assert all(lay.forward_ms > 4.5 for lay in stage.layers)
    assert all(lay.forward_ms < 1.0 for lay in graphs.layers), [lay.forward_ms for lay in graphs.layers]
