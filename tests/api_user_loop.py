"""A user's own training loop over pipeflow.Pipeline, as docs/api.md shows it: run under MPI by
tests/test_api.py (batched: `main(argv)`; or `mpirun -np N python -m tests.api_user_loop OUT SCHEDULE M
[PLAN]`). Writes OUT/losses-rank<R>.json (what step returned on each rank) and, on rank 0, OUT/model.pt.

The model, data and optimizer are `reference()`'s, the single-process training it must equal (float64).
`main_cli_data` trains pipeflow-train's mlp on its data order instead (CLI_ARGS), to equal that run.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeflow.models import mlp

STEPS, BATCH, LR = 3, 8, 0.1


def model() -> list[nn.Module]:
    """The same float64 layers on every rank (and in the reference): the mlp, whose layers pass tuples."""
    torch.manual_seed(0)
    return [layer.double() for layer in mlp.build(layers=4, d_in=4, hidden=8, samples=16).layers]


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=g, dtype=torch.float64), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(steps)]


def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process training: the whole minibatch's mean loss, one SGD step per minibatch."""
    net = nn.Sequential(*model())
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach() for k, v in net.state_dict().items()}, losses


def main(argv: list[str]) -> int:
    import pipeflow

    out, schedule, m = Path(argv[0]), argv[1], int(argv[2])
    plan = argv[3] if len(argv) > 3 else None
    with pipeflow.Pipeline(model(), F.cross_entropy, plan=plan, schedule=schedule, microbatches=m, device="cpu",
                           optimizer=lambda params: torch.optim.SGD(params, lr=LR)) as pipe:
        losses = [pipe.step(x, target=y) for x, y in batches()]
        state = pipe.state_dict()
        rank = pipe.world.rank
    return write_rank(out, f"losses-rank{rank}.json", losses, state)


def write_rank(out: Path, name: str, results: object, state: dict[str, torch.Tensor] | None) -> int:
    """One rank's results as out/name (JSON), and the model where the rank has it (rank 0); the loop's exit code."""
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(results))
    if state is not None:
        torch.save(state, out / "model.pt")
    return 0


# pipeflow-train's flags that main_cli_data's loop reproduces (with --schedule, --microbatches, --steps).
MLP_ARGS = {"layers": 4, "hidden": 8, "d_in": 4, "samples": 64}
CLI_ARGS = ["--model", "mlp", "--model-args", json.dumps(MLP_ARGS), "--device", "cpu", "--layers-per-stage", "even",
            "--microbatch-size", "2", "--optimizer", "sgd", "--lr", "0.05", "--dtype", "float64"]


def main_cli_data(argv: list[str]) -> int:
    """OUT SCHEDULE M STEPS: the loop pipeflow-train runs (CLI_ARGS), written over Pipeline.step: the model
    builder's layers, minibatch k = the loader's microbatches k*M .. k*M+M-1 joined; OUT/model.pt on rank 0."""
    import pipeflow
    from pipeflow.data.loader import MicrobatchLoader

    out, schedule, m, steps = Path(argv[0]), argv[1], int(argv[2]), int(argv[3])
    spec = pipeflow.build_model("mlp", MLP_ARGS, seed=0)
    loader = MicrobatchLoader(spec.dataset, 2, seed=0)
    with pipeflow.Pipeline(spec.layers, spec.loss_fn, schedule=schedule, microbatches=m, device="cpu",
                           dtype=torch.float64, optimizer=lambda params: torch.optim.SGD(params, lr=0.05)) as pipe:
        for k in range(steps):
            parts = [loader.microbatch(k * m + i) for i in range(m)]
            pipe.step(torch.cat([x for x, _ in parts]), target=torch.cat([y for _, y in parts]))
        state = pipe.state_dict()
    if state is not None:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "model.pt")
    return 0


def main_trainable_only(argv: list[str]) -> int:
    """OUT: the loop's model with its first layer frozen (fine-tuning) and an optimizer factory over the parameters
    that need gradients, as users filter them, on 2 stages: stage 0 has none. Writes OUT/error-rank<R>.txt, what
    Pipeline raised on this rank (empty: nothing)."""
    import pipeflow

    out = Path(argv[0])
    layers = model()
    for p in layers[0].parameters():
        p.requires_grad_(False)
    raised = ""
    try:
        with pipeflow.Pipeline(layers, F.cross_entropy, schedule="1f1b", microbatches=2, device="cpu",
                               plan=argv[1] if len(argv) > 1 else None,
                               optimizer=lambda ps: torch.optim.SGD([p for p in ps if p.requires_grad], lr=LR)) as pipe:
            for x, y in batches():
                pipe.step(x, target=y)
    except ValueError as e:
        raised = str(e)
    rank = int(os.environ.get("PMI_RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"error-rank{rank}.txt").write_text(raised)
    return 0


CLIP = 0.05  # main_clip_subset's max norm: every step's gradient is larger


def clip_subset_reference() -> dict[str, torch.Tensor]:
    """One process: an optimizer over every parameter but layer 1's (left trainable: its gradients add up from step
    to step, never zeroed), clip_grad_norm_ over the whole model before each step."""
    net = nn.Sequential(*model())
    opt = torch.optim.SGD([p for n, p in net.named_parameters() if not n.startswith("1.")], lr=LR)
    for x, y in batches():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
    return {k: v.detach() for k, v in net.state_dict().items()}


def main_clip_subset(argv: list[str]) -> int:
    """OUT: clip_subset_reference's training over Pipeline.step (2 stages, clip_grad_norm); OUT/model.pt on rank 0."""
    import pipeflow

    layers = model()
    left_out = {id(p) for p in layers[1].parameters()}
    with pipeflow.Pipeline(layers, F.cross_entropy, schedule="1f1b", microbatches=4, device="cpu", clip_grad_norm=CLIP,
                           optimizer=lambda ps: torch.optim.SGD([p for p in ps if id(p) not in left_out] or ps, lr=LR)
                           ) as pipe:
        for x, y in batches():
            pipe.step(x, target=y)
        state = pipe.state_dict()
    if state is not None:
        Path(argv[0]).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(argv[0]) / "model.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
