"""Pipeline.evaluate between Pipeline.step calls, as a user's loop: run under MPI by tests/test_evaluate.py (batched:
`main(argv)`; or `mpirun -np N python -m tests.api_eval_loop OUT SCHEDULE M MODEL [PLAN]`). It evaluates before the
first step and after each, two minibatches each time: microbatches of training's size and of another. Writes
OUT/rank<R>.json (step's and evaluate's returns, whether this rank owns the loss, whether every module's mode after
the loop is the one it had before, how many were in eval mode) and, on rank 0, OUT/model.pt.

`reference` is the same loop in one process (float64): training as pipeflow's flush schedules define it, and
evaluation as `model.eval(); with torch.no_grad(): mean of loss_fn(model(x_i), y_i)` over the microbatches, the
user's frozen module put back in eval mode after. `evaluate_state` evaluates given weights the same way.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeflow.data.loader import MicrobatchLoader
from pipeflow.spec import ModelSpec, build_model
from tests.api_user_loop import write_rank
from tests.reference import seed_of

# name -> (builder, model args); normdrop: fc, BatchNorm, relu and dropout in each of its first three layers
MODELS = {"mlp": ("mlp", {"layers": 4, "hidden": 8, "d_in": 4, "samples": 64}),
          "normdrop": ("tests.models:batchnorm_mlp", {"layers": 4, "samples": 64})}
STEPS, B, LR = 3, 2, 0.05
EVAL_SIZES = (B, 3)  # evaluation's microbatch sizes: training's (its shapes' cache must not mix) and another


def build(model: str) -> ModelSpec:
    """The model as every rank and the reference build it, the user's frozen module (normdrop: layer 1's dropout,
    left in eval mode) frozen."""
    spec = build_model(*MODELS[model], seed=0)
    freeze(spec.layers)
    return spec


def freeze(layers: Any) -> None:
    if len(layers) > 1 and isinstance(getattr(layers[1], "drop", None), nn.Dropout):
        layers[1].drop.eval()


def minibatch(loader: MicrobatchLoader, first: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [loader.microbatch(first + i) for i in range(m)]
    return torch.cat([x for x, _ in parts]).double(), torch.cat([y for _, y in parts])


def eval_batches(spec: ModelSpec, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    held_out = spec.eval_dataset if spec.eval_dataset is not None else spec.dataset
    return [minibatch(MicrobatchLoader(held_out, b, shuffle=False), 0, m) for b in EVAL_SIZES]


def evaluate_net(net: nn.Sequential, spec: ModelSpec, x: torch.Tensor, y: torch.Tensor, m: int) -> float:
    """One process's evaluation: model.eval(), no gradients, the mean of the microbatch losses; then train mode back
    with the frozen module frozen again."""
    net.eval()
    with torch.no_grad():
        losses = [float(spec.loss_fn(net(xi), yi)) for xi, yi in zip(x.chunk(m), y.chunk(m))]
    net.train()
    freeze(net)
    return sum(losses) / m


def evaluate_state(model: str, state: dict[str, torch.Tensor], m: int) -> list[float]:
    """Evaluation (both minibatches) of the weights `state`."""
    spec = build(model)
    net = nn.Sequential(*spec.layers).double()
    net.load_state_dict(state)
    return [evaluate_net(net, spec, x, y, m) for x, y in eval_batches(spec, m)]


def reference(model: str, m: int) -> tuple[dict[str, torch.Tensor], list[float], list[list[float]]]:
    """The loop in one process under flush semantics: the final state, each step's loss, each evaluation's."""
    spec = build(model)
    net = nn.Sequential(*spec.layers).double()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loader = MicrobatchLoader(spec.dataset, B, seed=0)
    held_out = eval_batches(spec, m)
    evals = [[evaluate_net(net, spec, x, y, m) for x, y in held_out]]
    losses = []
    for k in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for i in range(m):
            t = k * m + i
            x, y = loader.microbatch(t)
            h = x.double()
            for index, layer in enumerate(net):
                torch.manual_seed(seed_of(0, t, index))  # dropout's draws (docs/reproducibility.md)
                h = layer(h)
            loss = spec.loss_fn(h, y)
            (loss / m).backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total / m)
        evals.append([evaluate_net(net, spec, x, y, m) for x, y in held_out])
    return {k: v.detach() for k, v in net.state_dict().items()}, losses, evals


def main(argv: list[str]) -> int:
    import pipeflow

    out, schedule, m, model = Path(argv[0]), argv[1], int(argv[2]), argv[3]
    plan = argv[4] if len(argv) > 4 else None
    spec = build(model)
    loader = MicrobatchLoader(spec.dataset, B, seed=0)
    held_out = eval_batches(spec, m)
    got: dict[str, Any] = {"steps": [], "evals": []}
    with pipeflow.Pipeline(spec.layers, spec.loss_fn, plan=plan, schedule=schedule, microbatches=m, device="cpu",
                           dtype=torch.float64, optimizer=lambda params: torch.optim.SGD(params, lr=LR)) as pipe:
        def modes() -> list[bool]:
            return [sub.training for c in pipe.engine.stages.values() for sub in c.module.modules()]

        before = modes()
        got["evals"].append([pipe.evaluate(x, target=y) for x, y in held_out])
        for k in range(STEPS):
            got["steps"].append(pipe.step(*minibatch(loader, k * m, m)))
            got["evals"].append([pipe.evaluate(x, target=y) for x, y in held_out])
        got["modes_kept"] = modes() == before
        got["frozen"] = before.count(False)  # normdrop: the user's frozen dropout, on the rank holding layer 1
        got["owner"] = pipe.owns_loss
        state = pipe.state_dict()
        rank = pipe.world.rank
    return write_rank(out, f"rank{rank}.json", got, state)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
