"""How a stage's nn.Linear layers compute their weight gradients: the backward split into B (input gradients)
and W (weight gradients) of zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24, §2),
without running autograd twice; and gradient accumulation inside the weight GEMM.

Accumulation (gemm: plan.json's `accumulation`, which pipeflow-plan chooses, or PIPEFLOW_GRAD_ACCUM=gemm; autograd
is plain PyTorch's): every microbatch of a step but the first adds its weight gradients into `.grad`. Autograd
computes each into a new tensor, then adds it: on an H100 that made the backward of 13 GPT blocks (d 2048, bf16) 2.4
ms slower than into no gradients at microbatch 8 (+5.6%) and 1.8 ms at microbatch 2 (+15%). With `gemm` the weight
GEMM adds it itself (beta = 1, Megatron-LM's gradient accumulation fusion), in B and in W alike, which took back 1.7
and 1.1 ms of those. It costs host time (a Python autograd Function per nn.Linear, forward and backward, called
through the C apply: about 4.5 µs per call on the 2-core CPU machine, 8.7 before), so it pays only where the GPU,
not the host, sets the pace: 1f1b on 2 H100s ran 2.7% faster at microbatch 4 and 18% slower at microbatch 2
(benchmarks/gpu/README.md). Only where nothing observes the accumulation: the weight already has a `.grad` of the
gradient's dtype and no gradient hooks (a replica reducer registers its hooks only for the backward it listens to,
pipeflow/reduce.py); elsewhere autograd accumulates as before. The sum is rounded once instead of twice, so results
differ from autograd's in the last bits.

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
parametrization) or has a hook on its gradient (`register_hook`: it sees the whole gradient in B), or that runs
under autocast or a torch.func transform (grad, vmap: they differentiate the
plain F.linear). A tied weight used by a split Linear and by another module gets its Linear share in W and the
rest in B; both add into the one `.grad`. The Function's backward is made of differentiable ops, so a loss that
holds its own gradient (create_graph: a gradient penalty, a physics-informed loss) differentiates through it.
"""
from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

from partitioner.plan import ACCUMULATIONS  # plan.json's `accumulation` takes the same values
from pipeflow.received import received
from pipeflow.tensorops import random_like


def gemm_accumulation(environ: Mapping[str, str] = os.environ, *, planned: str | None = None) -> bool:
    """PIPEFLOW_GRAD_ACCUM: autograd (as plain PyTorch) or gemm (the weight GEMM adds into .grad); unset, the
    plan's choice (`planned`, plan.json's `accumulation`: pipeflow-plan picks gemm where the profile timed it
    faster), else autograd."""
    text = environ.get("PIPEFLOW_GRAD_ACCUM", planned or "autograd")
    if text not in ACCUMULATIONS:
        raise ValueError(f"PIPEFLOW_GRAD_ACCUM must be one of {', '.join(ACCUMULATIONS)}, found {text!r}")
    return text == "gemm"


def linear_notes(stages: Iterable[Any], *, split: bool, fuse: bool) -> list[str]:
    """A rank's stages' nn.Linear modules set to compute their weight gradients so (Stage.linear_backward); the log
    lines saying what they do."""
    n = sum(len(s.linear_backward(split=split, fuse=fuse)) for s in stages)
    return ([f"B defers the weight gradients of {n} nn.Linear module(s) to W (split.py)"] if split else []) + (
        [f"{n} nn.Linear module(s) add their weight gradients into .grad inside the GEMM (gemm accumulation)"]
        if fuse else [])


class WeightGradStore:
    """The deferred weight GEMMs of one stage, per microbatch (the W passes not run yet); `fuse`: weight
    gradients are added into .grad by their GEMM where nothing observes the accumulation."""

    def __init__(self, *, fuse: bool = False) -> None:
        self.fuse = fuse
        self.current: int | None = None  # the microbatch whose B is running (a plain attribute: CUDA's
        # autograd runs backward on a device thread, so a thread-local would not be seen there)
        # per microbatch: (weight, input, output gradient, the input's version when its forward saved it)
        self.pending: dict[int, list[tuple[nn.Parameter, torch.Tensor, torch.Tensor, int]]] = {}

    @contextlib.contextmanager
    def defer(self, mb: int) -> Iterator[None]:
        """Within: the split layers' backward records microbatch `mb`'s weight gradients (its B)."""
        self.current = mb
        self.pending.setdefault(mb, [])
        try:
            yield
        finally:
            self.current = None

    def record(self, weight: nn.Parameter, x: torch.Tensor, grad_out: torch.Tensor, version: int) -> None:
        assert self.current is not None
        self.pending[self.current].append((weight, x, grad_out, version))

    def weights(self, mb: int) -> list[nn.Parameter]:
        """The parameters W(mb) accumulates into, each once (what the replicas' reducer waits for)."""
        return list({id(p): p for p, *_ in self.pending.get(mb, [])}.values())

    def flush(self, mb: int) -> None:
        """W(mb): compute microbatch `mb`'s deferred weight gradients and accumulate them into `.grad`. A weight
        used several times is summed first, so its AccumulateGrad (and its hooks) runs once, as in a fused
        backward. An input changed in place since its forward (a workspace the next microbatch's forward
        overwrote) stops it, as autograd stops a backward that needs a changed tensor: W runs after later
        forwards than B does, and would otherwise compute the gradient from their data."""
        grads: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        with torch.no_grad():  # outside any backward: the GEMMs build no graph
            for p, x, g, version in self.pending.pop(mb, []):
                if x._version != version:
                    raise RuntimeError(
                        f"one of the variables needed for gradient computation has been modified by an inplace "
                        f"operation: the input of an nn.Linear (weight {tuple(p.shape)}), at version {x._version}; "
                        f"expected version {version}: a zero-bubble schedule computes weight gradients after later "
                        f"forwards (W), so a layer's input must not be changed in place after its forward; copy it "
                        f"(x.clone()) or use 1f1b")
                if self.fuse and id(p) not in grads and accumulate_into(p, x, g):
                    continue
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


def accumulate_into(weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """Add weight_grad(x, grad_out) into weight.grad inside the GEMM (beta = 1), if nothing would observe the
    accumulation autograd does: False (nothing done) where the weight has no .grad yet (autograd then takes the
    new tensor as it is, without a copy), one of another dtype or layout, or gradient hooks of any kind."""
    g = weight.grad
    if (g is None or g.dtype != grad_out.dtype or g.layout != torch.strided or g.requires_grad
            or torch.is_grad_enabled() or weight._backward_hooks or weight._post_accumulate_grad_hooks):
        return False
    g.addmm_(grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
    return True


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                store: WeightGradStore) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.weight, ctx.store, ctx.has_bias, ctx.x_version = weight, store, bias is not None, x._version
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Not once_differentiable: every op here is differentiable, so a double backward (create_graph) is
        # tracked through it; accumulate_into never adds into .grad while grad mode is on.
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        gx = grad_out.matmul(weight) if need_x else None
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        gb = g2.sum(0) if ctx.has_bias and need_b else None
        gw = None
        if need_w:
            store = ctx.store
            if store.current is not None:
                store.record(ctx.weight, x, grad_out, ctx.x_version)  # W computes it
            elif not (store.fuse and accumulate_into(ctx.weight, x, g2)):
                gw = weight_grad(x, g2)  # outside a B (a plain backward): autograd accumulates it
        return gx, gw, gb, None


# The C apply, without Function.apply's Python layer (functorch's wrapper unwrapping, setup_context binding: a
# third of the Function's host time per call); SplitLinear takes the plain F.linear under torch.func transforms.
_APPLY = super(torch.autograd.Function, _SplitLinearFn).apply


LINEAR_NODE = _SplitLinearFn._backward_cls  # its graph node: a Python Function that runs no nested backward


class SplitLinear(nn.Linear):
    """An nn.Linear whose weight gradient a WeightGradStore may defer or add into .grad inside its GEMM
    (installed by `install`; same parameters, state_dict and repr as the nn.Linear it was)."""

    _split_store: WeightGradStore

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        store = self.__dict__.get("_split_store")
        weight, bias = self._parameters.get("weight"), self._parameters.get("bias")
        if (store is None or not torch.is_grad_enabled() or weight is None or not weight.is_leaf
                or weight._backward_hooks  # a hook on the weight's gradient (a pruning mask) sees it in B, whole
                or torch.is_autocast_enabled(x.device.type) or torch._C._are_functorch_transforms_active()):
            return F.linear(x, self.weight, self.bias)  # torch.func transforms (grad, vmap) differentiate it natively
        return _APPLY(x, weight, bias, store)


def splittable(module: nn.Module) -> bool:
    """Exactly an nn.Linear (a subclass may compute differently, or be used through its weight alone)."""
    return type(module) is nn.Linear


def install(module: nn.Module, store: WeightGradStore) -> list[str]:
    """Make every nn.Linear inside `module` compute its weight gradient through `store` (deferred inside its
    `defer`, fused if it says so); returns their names."""
    names = []
    for name, m in module.named_modules():
        if splittable(m) or type(m) is SplitLinear:
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
    removed after, a store installed before put back (pass a copy: pipeflow-profile measures a sandbox copy)."""
    before = {name: m.__dict__.get("_split_store") for name, m in layer.named_modules() if type(m) is SplitLinear}
    store = WeightGradStore()
    if not install(layer, store):
        return None
    b_ms: list[float] = []
    w_ms: list[float] = []
    try:
        for it in range(warmup + repeats):
            ys = [t for t in tree_leaves(layer(received(x))) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not ys:
                return None
            grads = [random_like(t) for t in ys]

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
        for name, m in layer.named_modules():
            if (previous := before.get(name)) is not None:  # installed before (e.g. gemm accumulation): as it was
                install(m, previous)
    return statistics.median(b_ms), statistics.median(w_ms)
