"""Single-process training that pipeflow's distributed runs must equal (DESIGN.md, Equivalence)."""
from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from pipeflow.data.loader import MicrobatchLoader
from pipeflow.spec import build_model


def make_optimizer(name: str, params: Any, lr: float, momentum: float = 0.0) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=lr)


def reference_flush(model: str, model_args: dict[str, Any], *, steps: int, microbatches: int,
                    microbatch_size: int, optimizer: str = "sgd", lr: float = 0.05, momentum: float = 0.0,
                    seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """gpipe / 1f1b semantics: per step, the mean of m microbatch losses, one optimizer step."""
    spec = build_model(model, model_args, seed=seed)
    net = nn.Sequential(*spec.layers).to(dtype)
    opt = make_optimizer(optimizer, net.parameters(), lr, momentum)
    loader = MicrobatchLoader(spec.dataset, microbatch_size, seed=seed)
    for k in range(steps):
        opt.zero_grad()
        for i in range(microbatches):
            x, y = loader.microbatch(k * microbatches + i)
            x = x.to(dtype) if x.is_floating_point() else x
            (spec.loss_fn(net(x), y) / microbatches).backward()
        opt.step()
    return {k: v.detach() for k, v in net.state_dict().items()}


def args_json(d: dict[str, Any]) -> str:
    return json.dumps(d)
