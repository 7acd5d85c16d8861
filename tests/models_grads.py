"""Test-only models for the gradient seams (`--model tests.models_grads:NAME`): a parameter no forward
uses, a module applied twice under reentrant checkpointing, and wide cheap layers for memory runs."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset, TensorDataset

from pipeflow.spec import ModelSpec


class Inp(nn.Module):
    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class WithSpare(nn.Module):
    """`spare` is never used in forward: it gets no gradient, so no optimizer may move it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.spare = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Twice(nn.Module):
    """One Linear applied twice, each under reentrant checkpointing: its gradient is accumulated into
    .grad twice in one backward (two nested backwards), so per-hook counting calls it final too early."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def _apply_fc(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = checkpoint(self._apply_fc, x, use_reentrant=True)
        return checkpoint(self._apply_fc, y, use_reentrant=True)


class Out(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _data(d_in: int, classes: int, samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(samples, d_in, generator=g)
    y = (x @ torch.randn(d_in, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def unused(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: input, a layer with an unused Linear (`1.spare`), output."""
    layers: list[nn.Module] = [Inp(d_in, hidden), WithSpare(hidden), Out(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class Branches(nn.Module):
    """Two outputs that both require grad, (tanh(fc x), tanh(side x)); `uses` says which the next layer reads."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc, self.side = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.fc(x)), torch.tanh(self.side(x))


class FirstOnly(Out):
    """Out on the first of two tensors; with `sometimes`, the second added on the microbatches whose draw (seeded
    per microbatch and layer) is under a half."""

    def __init__(self, hidden: int, classes: int, sometimes: bool = False) -> None:
        super().__init__(hidden, classes)
        self.sometimes = sometimes

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        a, b = x
        return self.fc(a + b if self.sometimes and float(torch.rand(())) < 0.5 else a)


def dropped(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64, sometimes: bool = False
            ) -> ModelSpec:
    """Layers: input, Branches (`1.side` reaches the loss only through the second output), FirstOnly, which drops
    that output (always, or on some microbatches)."""
    layers: list[nn.Module] = [Inp(d_in, hidden), Branches(hidden), FirstOnly(hidden, classes, sometimes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class WithView(nn.Module):
    """(h, h[:, :2]): the second output a view inside the first (a [CLS] row beside the hidden states)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)  # no backward needs h itself: a later in-place change is allowed, as in one process
        return h, h[:, :2]


class ScaleView(nn.Module):
    """Scales the view in place (so, in one process, those elements of h too), then reads both."""

    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(hidden, classes), nn.Linear(2, classes)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, v = x
        v.mul_(3)
        return self.fc(h) + self.head(v)


class Reverse(torch.autograd.Function):
    """Gradient reversal (DANN): the identity forward, as a view; the gradient negated."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class WithReversed(WithView):
    """(h, reverse(h)): the second output shares h's memory but has a backward of its own."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc(x))
        return h, Reverse.apply(h)


class BothHeads(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc, self.domain = nn.Linear(hidden, classes), nn.Linear(hidden, classes)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.fc(x[0]) + self.domain(x[1])


def reversed_view(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: input, WithReversed, BothHeads: the reversed tensor crosses the boundary beside h."""
    layers: list[nn.Module] = [Inp(d_in, hidden), WithReversed(hidden), BothHeads(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


def viewed(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: input, WithView, ScaleView: cut between the last two, the view crosses the boundary with its base."""
    layers: list[nn.Module] = [Inp(d_in, hidden), WithView(hidden), ScaleView(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class Sometimes(nn.Module):
    """Adds `extra` on the microbatches whose draw (torch's generator, seeded per microbatch and layer) is under
    a half: in a step, one replica of its stage may hold a gradient of `extra` while another holds none."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.extra = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return h + self.extra if float(torch.rand(())) < 0.5 else h


def sometimes(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: input, a layer whose parameter `1.extra` only some microbatches use, output."""
    layers: list[nn.Module] = [Inp(d_in, hidden), Sometimes(hidden), Out(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


def twice(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: input, a Linear applied twice under reentrant checkpointing, output."""
    layers: list[nn.Module] = [Inp(d_in, hidden), Twice(hidden), Out(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class Scale(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class _Noise(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples drawn on access from their index: no memory held however many there are."""

    def __init__(self, features: int, size: int) -> None:
        self.features, self.size = features, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.features, generator=g), torch.randn(self.features, generator=g)


def wide(features: int = 1 << 20, layers: int = 2, samples: int = 1024) -> ModelSpec:
    """Elementwise scale layers: activations of `features` values per sample for almost no compute."""
    return ModelSpec(layers=[Scale(features) for _ in range(layers)], loss_fn=F.mse_loss,
                     dataset=_Noise(features, samples))


def activations(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: input, ReLU, Tanh, output: a plan may give the two middle ones a stage without any parameter."""
    layers: list[nn.Module] = [Inp(d_in, hidden), nn.ReLU(), nn.Tanh(), Out(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


def inplace_relu(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: Linear, ReLU(inplace=True), Linear, ReLU(inplace=True), output (torchvision's VGG and ResNet use such
    ReLUs, each after a layer whose backward does not need its output): a stage that starts at one changes its
    received input in place."""
    layers: list[nn.Module] = [nn.Linear(d_in, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, hidden),
                               nn.ReLU(inplace=True), Out(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class EmbedMean(nn.Module):
    """The mean of a sample's token embeddings, gradients sparse (nn.Embedding(sparse=True)); `mean` False:
    the embeddings themselves (their gradient, arriving from the next layer, becomes the sparse gradient's
    values without a copy)."""

    def __init__(self, vocab: int, hidden: int, mean: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, sparse=True)
        self.mean = mean

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids)
        return e.mean(dim=1) if self.mean else e


class Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def sparse_embedding(vocab: int = 20, hidden: int = 8, classes: int = 3, samples: int = 64,
                     raw: bool = False) -> ModelSpec:
    """Layers: a sparse-gradient embedding of 4 tokens a sample (with `raw`, the embeddings, then their mean as
    a layer of its own), Tanh, output."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (samples, 4), generator=g)
    y = torch.randint(0, classes, (samples,), generator=g)
    layers: list[nn.Module] = ([EmbedMean(vocab, hidden, mean=False), Mean()] if raw else [EmbedMean(vocab, hidden)])
    layers += [nn.Tanh(), Out(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=TensorDataset(ids, y))


class Named(nn.Module):
    """tanh(fc(x)) returned in a dict, beside a pair holding None and an int constant."""

    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, hidden)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.tanh(self.fc(x))
        return {"h": h, "pair": (h * 2, None), "n": 3}


class Unpack(nn.Module):
    """Reads Named's dict; returns (hidden, None), as an attention layer returns (output, weights)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, d: dict[str, Any]) -> tuple[torch.Tensor, None]:
        assert d["pair"][1] is None and d["n"] == 3, d
        return torch.tanh(self.fc(d["h"]) + d["pair"][0] * d["n"]), None


class First(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.out = Out(hidden, classes)

    def forward(self, t: tuple[torch.Tensor, None]) -> torch.Tensor:
        assert t[1] is None
        return self.out(t[0])


def structured(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers that pass a dict (a tensor, a pair with None, an int) and then (tensor, None) between them."""
    layers: list[nn.Module] = [Named(d_in, hidden), Unpack(hidden), First(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class Tagged(nn.Module):
    """Returns its output in a dict beside a set, which no stage can send."""

    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, hidden)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"h": self.fc(x), "tags": {1, 2}}


class Untag(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.out = Out(hidden, classes)

    def forward(self, d: dict[str, Any]) -> torch.Tensor:
        return self.out(d["h"])


def unsendable(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: one returning a set beside its tensor (fine in one process, not between stages), output."""
    layers: list[nn.Module] = [Tagged(d_in, hidden), Untag(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class SameTwice(nn.Module):
    """Returns one tensor twice, (h, h), as a block may return its output as both the hidden state and the skip."""

    def __init__(self, d_in: int, hidden: int, view_first: bool = False) -> None:
        super().__init__()
        self.fc, self.view_first = nn.Linear(d_in, hidden), view_first

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return (h.view(h.shape), h) if self.view_first else (h, h)  # a whole view before its base, or h twice


class AddInPlace(nn.Module):
    """Changes the first of its pair in place: in one process the second, the same tensor, changes with it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = t
        a.mul_(2.0)
        return torch.tanh(self.fc(a + b))


def returned_twice(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64,
                   view_first: bool = False) -> ModelSpec:
    """Layers: (h, h), or (h.view(h.shape), h), the pair's first changed in place, output."""
    layers: list[nn.Module] = [SameTwice(d_in, hidden, view_first), AddInPlace(hidden), Out(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class AppendRows(nn.Module):
    """tanh(fc(x)) with two learned rows appended to the batch: the gradient arriving for `rows` is a contiguous
    view of the incoming gradient, which autograd makes the parameter's .grad without a copy."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.rows = nn.Parameter(torch.randn(2, hidden) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tanh(self.fc(x)), self.rows])


class FoldRows(nn.Module):
    """Adds the two appended rows' sum to every sample and drops them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:-2] + x[-2:].sum(dim=0)


def appended_rows(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: input, AppendRows, FoldRows, output: split after AppendRows, stage 0's last parameter gets a view
    of the gradient stage 1 sends back."""
    layers: list[nn.Module] = [Inp(d_in, hidden), AppendRows(hidden), FoldRows(), Out(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class Memory(nn.Module):
    """Transformer-XL's recurrence in small: adds the previous microbatch's input to this layer (kept detached, as
    the next segment's memory) to its own. First on a stage, the input it keeps is a receive buffer."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.mem: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mem = self.mem if self.mem is not None and self.mem.shape == x.shape else torch.zeros_like(x)
        if self.training:
            self.mem = x.detach()
        return torch.tanh(self.fc(x) + mem / 2)


def kept_input(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: input, Memory, Tanh, output: split after the input, stage 1's Memory keeps a receive buffer."""
    layers: list[nn.Module] = [Inp(d_in, hidden), Memory(hidden), nn.Tanh(), Out(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


def frozen_prefix(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64, frozen: int = 2) -> ModelSpec:
    """Fine-tuning: input, 3 hidden layers and an output, the first `frozen` layers' parameters requires_grad=False
    (plus the last hidden layer's bias)."""
    layers: list[nn.Module] = [Inp(d_in, hidden), Inp(hidden, hidden), Inp(hidden, hidden), Inp(hidden, hidden),
                               Out(hidden, classes)]
    for layer in layers[:frozen]:
        layer.requires_grad_(False)
    layers[3].fc.bias.requires_grad_(False)
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class Halves(WithView):
    """(h[:, :4], h[:, 4:]): two tensors on one storage with no element in common."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        half = h.shape[1] // 2
        return h[:, :half], h[:, half:]


class Strided(WithView):
    """(h[:, ::2], h[:, :2]): neither holds the other, and they share h's first column."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h[:, ::2], h[:, :2]


class ScaleSecond(nn.Module):
    """Scales the second of two tensors in place, then reads both."""

    def __init__(self, first: int, second: int, classes: int) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(first, classes), nn.Linear(second, classes)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, v = x
        v.mul_(3)
        return self.fc(h) + self.head(v)


def halves(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: input, Halves, ScaleSecond: cut before the last, the halves cross apart."""
    layers: list[nn.Module] = [Inp(d_in, hidden), Halves(hidden), ScaleSecond(hidden // 2, hidden // 2, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


def strided(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Layers: input, Strided, ScaleSecond: cut before the last, the two overlapping views cross apart."""
    layers: list[nn.Module] = [Inp(d_in, hidden), Strided(hidden), ScaleSecond(hidden // 2, 2, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


def float64_after_activation(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """Built in float64 on float32 data, its first layer without parameters (ReLU): one process casts the inputs to
    the model's dtype, the first parameter's, so a first stage of the ReLU alone must too."""
    layers: list[nn.Module] = [nn.ReLU(), Inp(d_in, hidden), nn.Tanh(), Out(hidden, classes)]
    for layer in layers:
        layer.double()
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class Hidden(NamedTuple):
    """A layer's output by name (as transformers' ModelOutput-like tuples): the next layer reads `.hidden`."""

    hidden: torch.Tensor
    res: torch.Tensor


class ByName(nn.Module):
    """tanh(fc(x)) as Hidden(h, h / 2), or nested, (Hidden(h, h), h / 2); reads its input by field name."""

    def __init__(self, d_in: int, hidden: int, nested: bool) -> None:
        super().__init__()
        self.fc, self.nested = nn.Linear(d_in, hidden), nested

    def forward(self, x: Any) -> Any:
        if isinstance(x, Hidden):
            x = x.hidden + x.res
        elif isinstance(x, tuple):
            x = x[0].hidden + x[1]
        h = torch.tanh(self.fc(x))
        return (Hidden(h, h), 0.5 * h) if self.nested else Hidden(h, 0.5 * h)


def named_outputs(d_in: int = 6, hidden: int = 8, classes: int = 3, samples: int = 64,
                  nested: bool = False) -> ModelSpec:
    """Layers that return a named tuple the next one reads by name (flat, or nested in a tuple), then a head."""
    layers: list[nn.Module] = [ByName(d_in, hidden, nested), ByName(hidden, hidden, nested),
                               ByName(hidden, hidden, nested), nn.Sequential(_Sum(), Out(hidden, classes))]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(d_in, classes, samples))


class _Sum(nn.Module):
    def forward(self, x: Any) -> torch.Tensor:
        return x.hidden + x.res if isinstance(x, Hidden) else x[0].hidden + x[1]
