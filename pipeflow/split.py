"""The backward split into B (input gradients) and W (weight gradients) of zero-bubble schedules (Qi et al.,
"Zero Bubble Pipeline Parallelism", ICLR'24, §2), without running autograd twice.

Which layers split: every `nn.Linear` instance (exactly that type) of a stage whose forward runs through its own
`forward`. Its autograd Function's backward returns the input gradient and the bias gradient (cheap) at once;
while a `WeightGradStore.defer(i)` context is active (the B of microbatch i) it records (weight, input, output
gradient) for microbatch i instead of computing the weight GEMM, and `WeightGradStore.flush(i)` (the W) runs
those GEMMs and accumulates the gradients through autograd (`torch.autograd.backward` on the weights as roots),
so `.grad`, gradient hooks and the replicas' post-accumulate hooks (pipeflow/reduce.py) see exactly what a
fused backward would give them. That is the ZB reference's WeightGradStore, for any nn.Module layer list.

What falls back to the fused backward in B: every other module with parameters (LayerNorm, Embedding, Conv,
...); subclasses of nn.Linear and parameters used outside `Linear.forward` (nn.MultiheadAttention's
`out_proj`, whose weight the attention reads directly); a Linear whose weight is not a leaf (a
parametrization) or that runs under autocast. A tied weight used by a split Linear and by another module gets
its Linear share in W and the rest in B; both add into the one `.grad`.
"""
from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_leaves


class WeightGradStore:
    """The deferred weight GEMMs of one stage, per microbatch (the W passes not run yet)."""

    def __init__(self) -> None:
        self.current: int | None = None  # the microbatch whose B is running (a plain attribute: CUDA's
        # autograd runs backward on a device thread, so a thread-local would not be seen there)
        self.pending: dict[int, list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = {}

    @contextlib.contextmanager
    def defer(self, mb: int) -> Iterator[None]:
        """Within: the split layers' backward records microbatch `mb`'s weight gradients (its B)."""
        self.current = mb
        self.pending.setdefault(mb, [])
        try:
            yield
        finally:
            self.current = None

    def record(self, weight: nn.Parameter, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        assert self.current is not None
        self.pending[self.current].append((weight, x, grad_out))

    def weights(self, mb: int) -> list[nn.Parameter]:
        """The parameters W(mb) accumulates into, each once (what the replicas' reducer waits for)."""
        return list({id(p): p for p, _, _ in self.pending.get(mb, [])}.values())

    def flush(self, mb: int) -> None:
        """W(mb): compute microbatch `mb`'s deferred weight gradients and accumulate them into `.grad`. A weight
        used several times is summed first, so its AccumulateGrad (and its hooks) runs once, as in a fused
        backward."""
        grads: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        for p, x, g in self.pending.pop(mb, []):
            gw = weight_grad(x, g)
            grads[id(p)] = (p, grads[id(p)][1] + gw) if id(p) in grads else (p, gw)
        if grads:
            params, values = zip(*grads.values())
            torch.autograd.backward(list(params), list(values))

    def clear(self) -> None:
        self.pending.clear()
        self.current = None


def weight_grad(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """dL/dW of y = x W^T + b: grad_out^T x over every leading dimension, the weight GEMM W defers."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                store: WeightGradStore) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.weight, ctx.store, ctx.has_bias = weight, store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        gx = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        gb = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        gw = None
        if ctx.needs_input_grad[1]:
            if ctx.store.current is not None:
                ctx.store.record(ctx.weight, x, grad_out)  # W computes it
            else:
                gw = weight_grad(x, grad_out)  # outside a B (a plain backward): fused
        return gx, gw, gb, None


class SplitLinear(nn.Linear):
    """An nn.Linear whose weight gradient a WeightGradStore may defer (installed by `install`; same
    parameters, state_dict and repr as the nn.Linear it was)."""

    _split_store: WeightGradStore

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        store = self.__dict__.get("_split_store")
        if (store is None or not self.weight.is_leaf or torch.is_autocast_enabled(x.device.type)
                or not torch.is_grad_enabled()):
            return F.linear(x, self.weight, self.bias)
        return _SplitLinearFn.apply(x, self.weight, self.bias, store)


def splittable(module: nn.Module) -> bool:
    """Exactly an nn.Linear (a subclass may compute differently, or be used through its weight alone)."""
    return type(module) is nn.Linear


def install(module: nn.Module, store: WeightGradStore) -> list[str]:
    """Make every nn.Linear inside `module` defer its weight gradient into `store`; returns their names."""
    names = []
    for name, m in module.named_modules():
        if splittable(m):
            m.__class__ = SplitLinear
            m.__dict__["_split_store"] = store
            names.append(name)
    return names


def uninstall(module: nn.Module) -> None:
    """Undo `install`: the modules are plain nn.Linear again."""
    for m in module.modules():
        if type(m) is SplitLinear:
            m.__class__ = nn.Linear  # type: ignore[assignment]
            m.__dict__.pop("_split_store", None)


def split_report(module: nn.Module) -> tuple[list[str], list[str]]:
    """(names of the modules whose weight gradient would be split, names of the other modules that own
    parameters directly and keep the fused backward), for docs and the profiler."""
    split, fused = [], []
    for name, m in module.named_modules():
        if splittable(m) or type(m) is SplitLinear:
            split.append(name)
        elif any(True for _ in m.parameters(recurse=False)):
            fused.append(name)
    return split, fused


def time_split_backward(layer: nn.Module, x: Any, timer: Callable[[Callable[[], Any]], float], *, warmup: int,
                        repeats: int) -> tuple[float, float] | None:
    """Median ms of B (input gradients, weight GEMMs deferred) and of W of `layer` on input `x`, for the
    profiler; None when the layer has no split nn.Linear. The split is installed for the measurement and
    removed after (pass a copy: pipeflow-profile measures a sandbox copy of each layer)."""
    store = WeightGradStore()
    if not install(layer, store):
        return None
    b_ms: list[float] = []
    w_ms: list[float] = []
    try:
        for it in range(warmup + repeats):
            ys = [t for t in tree_leaves(layer(x)) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not ys:
                return None
            grads = [torch.randn_like(t) for t in ys]

            def backward_input(ys: list[torch.Tensor] = ys, grads: list[torch.Tensor] = grads) -> None:
                with store.defer(0):
                    torch.autograd.backward(ys, grads)

            t_b, t_w = timer(backward_input), timer(lambda: store.flush(0))
            if it >= warmup:
                b_ms.append(t_b)
                w_ms.append(t_w)
            layer.zero_grad(set_to_none=True)
    finally:
        store.clear()
        uninstall(layer)
    return statistics.median(b_ms), statistics.median(w_ms)
