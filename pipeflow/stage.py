"""One stage's layers: forward and backward per microbatch, keeping what backward needs in between.

Randomness inside layers (dropout) follows docs/reproducibility.md: before global layer i runs on
global microbatch t, the default generators of the stage's device (and the CPU one) are seeded with
``layer_seed(seed, t, i)``, so what a layer draws depends on (seed, t, i) alone, never on the plan, the
replica or the rank. The seed is a splitmix64 chain (Steele et al., OOPSLA'14)::

    h = mix(seed mod 2**64); h = mix(h ^ t); h = mix(h ^ i); seed_of_layer = h >> 1   (63 bits)

Seeding a generator only sets host-side state (CUDA's Philox seed and offset), so it adds no device
synchronisation. Nothing is restored afterwards: after set-up nothing else in a training process draws
from the default generators (the data order has its own generator).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from pipeflow.data.loader import batch_leaf
from pipeflow.failure import UsageError
from pipeflow.received import received
from pipeflow.seeds import layer_seed
from pipeflow.spec import model_dtype
from pipeflow.split import WeightGradStore, install
from pipeflow.structure import OutputError, Tree, check_shared, join, shared_versions, split


def _as_tuples(x: Any) -> Any:
    """Tuples and lists anywhere in a batch (named tuples included) become plain tuples: the first
    stage's layers see one structure whatever built the batch. Structure only; tensors go through tree_map."""
    if isinstance(x, (tuple, list)):
        return tuple(_as_tuples(v) for v in x)
    return x


def to_device(x: Any, device: torch.device) -> Any:
    """The tensors of a batch (a tensor or nested tuples, lists and dicts of them, lists made tuples) on `device`;
    anything else is passed as it is."""
    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if device.type == "cuda" and t.device.type == "cpu":
            # Pinned memory makes the copy truly asynchronous: no host sync in the steady state.
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device, non_blocking=True)
    return tree_map(move, _as_tuples(x), is_leaf=batch_leaf)


@dataclass
class _Saved:
    inputs: list[torch.Tensor]   # received tensors that require grad (leaves of this stage's graph)
    outputs: list[torch.Tensor]  # outputs whose gradient comes back from downstream (or the loss)


class Stage:
    """Layers [start, end) of the model as one nn.Sequential (its state_dict keys are local indices).

    `dtype` None keeps the layers' own dtype; the first stage then casts floating inputs to the dtype of
    the model's first floating-point parameter (its own, else `inputs`), as one process does. `seed` is --seed: it
    seeds each layer's randomness per microbatch (module docstring)."""

    def __init__(self, layers: list[nn.Module], *, start: int, first: bool, last: bool,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None, device: torch.device,
                 dtype: torch.dtype | None = None, seed: int = 0, inputs: torch.dtype | None = None) -> None:
        self.module = nn.Sequential(*layers).to(device=device, dtype=dtype)
        self.start = start
        self.first, self.last = first, last
        self.loss_fn = loss_fn
        self.device = device
        # `inputs`: the whole model's dtype (graphs.make_stages), for a first stage without parameters; None: none
        self.dtype = dtype or model_dtype(self.module) or inputs
        self.seed = seed
        self.generators = [torch.default_generator]
        if device.type == "cuda":  # dropout on a CUDA tensor draws from that device's generator
            torch.cuda.init()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.generators.append(torch.cuda.default_generators[index])
        self.saved: dict[int, _Saved] = {}
        self.weight_store: WeightGradStore | None = None  # set by linear_backward(split=True)
        self.trees: dict[int, Tree] = {}  # microbatch -> what surrounds its sent tensors, until sent (structure.py)

    def linear_backward(self, *, split: bool, fuse: bool) -> list[str]:
        """How the stage's nn.Linear layers compute weight gradients from now on (pipeflow/split.py). `split`
        (zero-bubble schedules): `backward` (B) defers their weight GEMMs and `backward_weights` (W) runs them;
        `fuse`: each GEMM adds into .grad itself. Returns the names of the modules that changed."""
        if not (split or fuse):
            return []
        store = WeightGradStore(fuse=fuse)
        self.weight_store = store if split else None
        return install(self.module, store)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """These layers' weights on the CPU under the model-wide keys of nn.Sequential(*spec.layers)."""
        out = {}
        for k, v in self.module.state_dict().items():
            idx, _, rest = k.partition(".")
            out[f"{int(idx) + self.start}.{rest}"] = v.detach().cpu()
        return out

    def forward(self, mb: int, inputs: list[torch.Tensor] | Any, target: torch.Tensor | None = None,
                *, loss_scale: float = 1.0, global_mb: int | None = None, tree: Tree = None) -> list[torch.Tensor]:
        """Run the layers on one microbatch. A received input list is put back into the structure the previous
        stage's layer returned (`tree`, structure.py). On the last stage returns [loss] (detached, unscaled);
        elsewhere the tensors to send (their structure in `trees[mb]`). `global_mb` is the microbatch's index in
        the data order (default `mb`): it seeds the layers."""
        if self.first:
            x = self._batch(inputs)
            leaves: list[torch.Tensor] = []
        else:
            leaves = [t for t in inputs if t.requires_grad]
            x = join(received(inputs), tree)  # may be changed in place (received.py); views of the aliases
        out = self._run(mb if global_mb is None else global_mb, x, None if self.first else inputs, tree)
        if self.last:
            loss = self._loss(out, target)
            self.saved[mb] = _Saved(leaves, [loss * loss_scale])
            return [loss.detach()]
        outs, self.trees[mb] = self._split(out)
        self.saved[mb] = _Saved(leaves, [t for t in outs if t.requires_grad])
        return outs

    def evaluate(self, t: int, inputs: list[torch.Tensor] | Any, target: torch.Tensor | None = None, *,
                 tree: Tree = None) -> tuple[list[torch.Tensor], Tree]:
        """Forward only (pipeflow/evaluate.py, under torch.no_grad): nothing is kept for a backward. On the last
        stage ([loss], None), elsewhere the tensors to send and their structure. `t` seeds the layers."""
        x = self._batch(inputs) if self.first else join(inputs, tree)
        out = self._run(t, x, None if self.first else inputs, tree)
        return ([self._loss(out, target)], None) if self.last else self._split(out)

    def _run(self, t: int, x: Any, inputs: list[torch.Tensor] | None, tree: Tree) -> Any:
        """run_layers; where x holds tensors received from the previous stage (`inputs`, None on the first), then
        check that the layers changed none of those that shared memory there in place (structure.check_shared)."""
        watch = None if inputs is None else shared_versions(inputs, tree)
        out = self.run_layers(t, x)
        if watch is not None and inputs is not None:
            check_shared(inputs, tree, watch, self._name())
        return out

    def _name(self) -> str:
        """These layers, as an error names them."""
        return f"layers {self.start}-{self.start + len(self.module) - 1}" if len(self.module) > 1 else \
            f"layer {self.start} ({type(self.module[0]).__name__})"

    def _batch(self, inputs: Any) -> Any:
        """The first stage's input: on the device, floating tensors in the stage's dtype."""
        x = to_device(inputs, self.device)
        return _cast_floats(x, self.dtype) if self.dtype is not None else x

    def _loss(self, out: Any, target: torch.Tensor | None) -> torch.Tensor:
        if self.loss_fn is None or target is None:
            raise RuntimeError("the last stage needs a loss function and a target")
        loss = self.loss_fn(out, to_device(target, self.device))
        # Checked before its backward, which would fail with autograd's traceback on this rank alone ("grad can be
        # implicitly created only for scalar outputs", "element 0 of tensors does not require grad").
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
            found = (f"a {type(loss).__name__}" if not isinstance(loss, torch.Tensor) else
                     f"a tensor of shape {tuple(loss.shape)} and dtype {str(loss.dtype).removeprefix('torch.')}")
            raise UsageError(f"the loss must be one floating-point number per microbatch (a 0-dim tensor, e.g. a mean "
                             f"over its samples); loss_fn returned {found}")
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise UsageError("the loss needs a gradient to train on, but loss_fn returned a tensor that does not "
                             "require grad: was it computed under torch.no_grad(), or from .detach()ed outputs?")
        return loss

    def _split(self, out: Any) -> tuple[list[torch.Tensor], Tree]:
        try:
            return split(out)
        except OutputError as e:  # a split given by hand: the profiler has not seen this output
            layer = self.start + len(self.module) - 1
            raise OutputError(f"layer {layer} ({type(self.module[-1]).__name__}), the last of its stage: {e}") from None

    def run_layers(self, t: int, x: Any) -> Any:
        """The layers one by one, as nn.Sequential would, each after seeding for (seed, t, layer)."""
        for k, layer in enumerate(self.module):
            s = layer_seed(self.seed, t, self.start + k)
            for g in self.generators:
                g.manual_seed(s)
            x = layer(x)
        return x

    def backward(self, mb: int, grads: list[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """Backward of one microbatch from the outputs a gradient came back for (None: the next stage did not use
        that output); returns the gradients of the inputs that required grad, None for one the layers did not use
        (pipeflow/gradients.py: the parameters behind it keep no gradient, as in one process)."""
        saved = self.saved.pop(mb)
        store = self.weight_store
        with store.defer(mb) if store is not None else contextlib.nullcontext():
            if self.last:
                torch.autograd.backward(saved.outputs)
            elif saved.outputs:
                assert grads is not None and len(grads) == len(saved.outputs), "gradient count mismatch"
                given = [(o, g) for o, g in zip(saved.outputs, grads) if g is not None]
                if given:
                    torch.autograd.backward([o for o, _ in given], [g for _, g in given])
        return [t.grad for t in saved.inputs]

    def backward_weights(self, mb: int) -> None:
        """W of microbatch `mb`: the weight gradients its B deferred, accumulated into .grad (nothing to do
        without a split backward)."""
        if self.weight_store is not None:
            self.weight_store.flush(mb)

    def deferred_weights(self, mb: int) -> list[nn.Parameter]:
        """The parameters `backward_weights(mb)` will accumulate into, each once."""
        return self.weight_store.weights(mb) if self.weight_store is not None else []


def mark_requires_grad(tensors: list[torch.Tensor], flags: list[bool]) -> list[torch.Tensor]:
    """Received tensors become leaves that require grad where the sender's did."""
    for t, f in zip(tensors, flags):
        if f:
            t.requires_grad_(True)
    return tensors


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of a batch in `dtype`; integer tensors (token ids) and anything else as they are."""
    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t
    return tree_map(cast, x, is_leaf=batch_leaf)
