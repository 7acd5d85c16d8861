"""A user's loop over pipeflow.Pipeline that freezes and unfreezes layers between steps (progressive unfreezing,
fine-tuning), run by tests/test_trainable.py (batched: `main(argv)`). The model and data are tests/api_user_loop.py's
(float64, four layers passing tuples); FROZEN says which layers are frozen during each step: layer 1 first, then
none, then layers 0 and 1 (the first stage of a two-stage split, whole: nothing crosses back to it), then layer 3.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tests.api_user_loop import LR, batches, model

FROZEN = [{1}, set(), {0, 1}, {3}]
CLIP = 0.05  # every step's gradient is larger: each update is clipped
MOMENTUM = 0.9  # a parameter without a gradient keeps its momentum: a zero gradient would move it


def set_frozen(layers: list[nn.Module], frozen: set[int]) -> None:
    for i, layer in enumerate(layers):
        layer.requires_grad_(i not in frozen)


def reference(*, clip: bool = True, momentum: float = MOMENTUM) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: the same freezing, the whole minibatch's mean loss, clip_grad_norm_ over the model, SGD."""
    layers = model()
    net = nn.Sequential(*layers)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=momentum)
    norms = []
    for frozen, (x, y) in zip(FROZEN, batches(len(FROZEN))):
        set_frozen(layers, frozen)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        if clip:
            norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
    return {k: v.detach() for k, v in net.state_dict().items()}, norms


def main(argv: list[str]) -> int:
    """OUT SCHEDULE PLAN|- [shard | lr0]: the loop; OUT/model.pt and OUT/norms.json on rank 0, OUT/error-rank<R>.txt
    (what Pipeline.step raised on each rank, empty for nothing). `lr0` (async, plain SGD): instead of freezing, each
    frozen layer's param group gets lr 0 for the step, which trains the same weights."""
    import pipeflow

    out, schedule, plan, mode = Path(argv[0]), argv[1], argv[2], argv[3] if len(argv) > 3 else ""
    clip = schedule != "async"  # async updates per microbatch: no global norm (config.check_clip_grad_norm)
    layers = model()
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    momentum = MOMENTUM if clip else 0.0

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": [p]} for p in params], lr=LR, momentum=momentum)

    state, norms, raised = None, [], ""
    with pipeflow.Pipeline(layers, F.cross_entropy, plan=None if plan == "-" else plan, schedule=schedule,
                           microbatches=4, device="cpu", clip_grad_norm=CLIP if clip else None,
                           shard_optimizer=mode == "shard", optimizer=optimizer) as pipe:
        try:
            for frozen, (x, y) in zip(FROZEN, batches(len(FROZEN))):
                if mode == "lr0":
                    for group in pipe.optimizer.param_groups:
                        group["lr"] = 0.0 if layer_of[id(group["params"][0])] in frozen else LR
                else:
                    set_frozen(layers, frozen)
                pipe.step(x, target=y)
                if clip:
                    norms.append(pipe.grad_norm())
        except ValueError as e:
            raised = str(e)
        if not raised:
            state = pipe.state_dict()
        rank = pipe.world.rank
    out.mkdir(parents=True, exist_ok=True)
    (out / f"error-rank{rank}.txt").write_text(raised)
    if state is not None:
        torch.save(state, out / "model.pt")
        (out / "norms.json").write_text(json.dumps(norms))
    return 0
