"""Small test-only models for `--model tests.models:NAME` (dropout, BatchNorm, an EMA buffer, lazy layers, a float64
build, NaN inputs)."""
from __future__ import annotations

import gc
import os
import sys
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from pipeflow.models import mlp
from pipeflow.spec import ModelSpec

DTYPES = {"float32": torch.float32, "float64": torch.float64}


class DropLayer(nn.Module):
    """tanh(fc(h)) then dropout, on all columns but the last, which carries the sample id through.

    `probe`: first draw one number from the default generator and print it with the layer index and the
    microbatch's first sample id, so a test can check what each (microbatch, layer) drew."""

    def __init__(self, index: int, d_in: int, d_out: int, p: float, probe: bool) -> None:
        super().__init__()
        self.index, self.probe = index, probe
        self.fc = nn.Linear(d_in, d_out)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, ids = x[:, :-1], x[:, -1:]
        if self.probe:
            r = torch.rand((), dtype=torch.float64)
            sys.stderr.write(f"probe layer={self.index} sample={int(ids[0, 0])} draw={float(r)!r}\n")
        return torch.cat([self.drop(torch.tanh(self.fc(h))), ids.detach()], dim=1)


class Head(nn.Module):
    def __init__(self, d_in: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x[:, :-1])


def _data(samples: int, d_in: int, classes: int) -> TensorDataset:
    """Features from a fixed generator, then the sample's index as the last column; a teacher's labels."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(samples, d_in, generator=g)
    y = (x @ torch.randn(d_in, classes, generator=g)).argmax(dim=1)
    return TensorDataset(torch.cat([x, torch.arange(samples, dtype=x.dtype)[:, None]], dim=1), y)


def dropout_mlp(layers: int = 4, d_in: int = 6, hidden: int = 8, classes: int = 3, p: float = 0.3,
                samples: int = 256, probe: bool = False, dtype: str = "float32") -> ModelSpec:
    """`layers - 1` DropLayers (dropout in each) and a linear head; `dtype` is the dtype it is built in."""
    mods: list[nn.Module] = [DropLayer(0, d_in, hidden, p, probe)]
    mods += [DropLayer(i, hidden, hidden, p, probe) for i in range(1, layers - 1)]
    mods.append(Head(hidden, classes))
    for m in mods:
        m.to(DTYPES[dtype])
    return ModelSpec(layers=mods, loss_fn=F.cross_entropy, dataset=_data(samples, d_in, classes))


def nan_mlp(bad: tuple[int, ...] | list[int] = (16,), **kw: int) -> ModelSpec:
    """The mlp with a NaN input at each sample of `bad`: with --no-shuffle and 4 microbatches of 2, sample 8k is
    step k+1's first (16: step 3's), that is microbatch 4k's (async: update 4k+1 of each stage)."""
    spec = mlp.build(**kw)
    x, y = spec.dataset.tensors  # type: ignore[attr-defined]
    x = x.clone()
    x[list(bad), 0] = float("nan")
    spec.dataset = TensorDataset(x, y)
    return spec


# weakrefs to every layer built with report_alive, and the last alive set a forward reported.
_BUILT: list[weakref.ref[nn.Module]] = []
_LAST: list[list[int]] = [[]]


class NormLayer(nn.Module):
    """fc, BatchNorm1d, relu, dropout. `report_alive`: each forward of a built layer (not of the profiler's
    copies) collects garbage and prints (when it changed) which layers of the model are still alive here."""

    def __init__(self, d_in: int, d_out: int, p: float, report_alive: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.bn = nn.BatchNorm1d(d_out)
        self.drop = nn.Dropout(p)
        self.report_alive = report_alive
        self._origin = id(self)  # a deep copy (the profiler's sandbox) differs: only the built layer reports

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.report_alive and self._origin == id(self):  # the profiler's copies would gc per forward: 12 s
            gc.collect()
            alive = [i for i, r in enumerate(_BUILT) if r() is not None]
            if alive != _LAST[0]:
                _LAST[0] = alive
                rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1"))
                sys.stderr.write(f"rank={rank} alive layers={alive}\n")
        return self.drop(torch.relu(self.bn(self.fc(x))))


def batchnorm_mlp(layers: int = 4, d_in: int = 6, hidden: int = 8, classes: int = 3, p: float = 0.2,
                  samples: int = 256, report_alive: bool = False) -> ModelSpec:
    """`layers - 1` NormLayers and a linear head (inputs without the id column)."""
    mods: list[nn.Module] = [NormLayer(d_in, hidden, p, report_alive)]
    mods += [NormLayer(hidden, hidden, p, report_alive) for _ in range(layers - 2)]
    mods.append(nn.Linear(hidden, classes))
    if report_alive:
        _BUILT[:] = [weakref.ref(m) for m in mods]
    data = _data(samples, d_in, classes)
    x, y = data.tensors
    return ModelSpec(layers=mods, loss_fn=F.cross_entropy, dataset=TensorDataset(x[:, :-1], y))


class EmaLayer(nn.Module):
    """tanh(fc(x) - ema): a training forward moves `ema` towards the microbatch's mean, as a BatchNorm-free
    running normaliser does (a buffer that pipeflow/replicabuffers.py finds changed); `scale` never changes."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("ema", torch.zeros(d))
        self.register_buffer("scale", torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.7).add_(0.3 * h.mean(0))
        return torch.tanh(h - self.ema) * self.scale


def ema_mlp(layers: int = 3, d: int = 6, classes: int = 3, samples: int = 64) -> ModelSpec:
    """`layers - 1` EmaLayers and a linear head."""
    data = _data(samples, d, classes)
    x, y = data.tensors
    mods: list[nn.Module] = [EmaLayer(d) for _ in range(layers - 1)] + [nn.Linear(d, classes)]
    return ModelSpec(layers=mods, loss_fn=F.cross_entropy, dataset=TensorDataset(x[:, :-1], y))


def lazy_mlp(d: int = 6, classes: int = 3, samples: int = 32) -> ModelSpec:
    """nn.LazyLinear layers, never run: their parameters are uninitialized (refused by ModelSpec)."""
    x, y = _data(samples, d, classes).tensors
    return ModelSpec(layers=[nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(classes)], loss_fn=F.cross_entropy,
                     dataset=TensorDataset(x[:, :-1], y))


_WRITTEN: dict[str, list[float]] = {}  # per witness log: when this process last wrote to it, how many times, forwards


class Witness(nn.Module):
    """tanh(fc(x)) that appends "pid time" (CLOCK_MONOTONIC, shared by the machine's processes) to `log` on a
    forward, the first one and then at most every 10 ms per process: which processes ran the model, and when."""

    def __init__(self, d: int, log: str, die_unless_pid: int = 0, die_after: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.log, self.die_unless_pid, self.die_after = log, die_unless_pid, die_after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        written = _WRITTEN.setdefault(self.log, [-1.0, 0, 0])
        written[2] += 1
        if self.die_unless_pid == os.getpid():
            time.sleep(0.01)  # the profiler's process: slow, so that the companion dies while it profiles
        elif self.die_unless_pid and written[2] > self.die_after:  # the first forward after its first pass: ready
            sys.stderr.write("this process gives up\n")
            sys.stderr.flush()
            os._exit(3)
        now = time.monotonic()
        if now - written[0] >= 0.01:
            written[0], written[1] = now, written[1] + 1
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {now}\n")
        return torch.tanh(self.fc(x))


def witness_mlp(log: str, layers: int = 3, d: int = 16, samples: int = 64, only_pid: int = 0,
                die_unless_pid: int = 0) -> ModelSpec:
    """`layers` Witness layers writing to `log`; with `only_pid`, building it in another process fails; with
    `die_unless_pid`, another process running it exits (code 3) at its first forward after its first pass (the
    companion's "ready", partitioner/companion.py), and that process sleeps 10 ms in each forward: the profile beside
    the companion lasts long enough for a loaded machine to run it to its end."""
    if only_pid and os.getpid() != only_pid:
        raise ValueError(f"built in process {os.getpid()}, only {only_pid} may build it")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(samples, d, generator=g)
    return ModelSpec(layers=[Witness(d, log, die_unless_pid, layers) for _ in range(layers)], loss_fn=F.mse_loss,
                     dataset=TensorDataset(x, torch.tanh(x)))


class _TokenDicts(torch.utils.data.Dataset):
    """Samples ({"input_ids", "attention_mask", "scale"}, label), as Hugging Face datasets give their inputs."""

    def __init__(self, samples: int, vocab: int, tokens: int, classes: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (samples, tokens), generator=g)
        self.mask = torch.rand(samples, tokens, generator=g) > 0.3
        self.scale = torch.rand(samples, generator=g) + 0.5  # a float input: cast to the model's dtype
        self.y = self.ids.sum(dim=1) % classes

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "scale": self.scale[i]}, self.y[i]


class MaskedMean(nn.Module):
    """The attention mask's mean of the token embeddings, times the sample's scale."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["attention_mask"].to(self.embed.weight.dtype)[..., None]
        mean = (self.embed(batch["input_ids"]) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return mean * batch["scale"][:, None]


class Tanh(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def dict_input(vocab: int = 30, tokens: int = 5, hidden: int = 8, classes: int = 3, samples: int = 64) -> ModelSpec:
    """A dict input (input ids, an attention mask, a float scale per sample), then 2 Tanh layers and a head."""
    layers: list[nn.Module] = [MaskedMean(vocab, hidden), Tanh(hidden), Tanh(hidden), nn.Linear(hidden, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_TokenDicts(samples, vocab, tokens, classes))


class TiedHead(nn.Module):
    """The head of `shared_mlp`: the input layer's weight, transposed (a tied embedding and head)."""

    def __init__(self, inp: nn.Linear) -> None:
        super().__init__()
        self.inp = inp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.inp.weight.t())


def shared_mlp(d_in: int = 6, hidden: int = 8, repeats: int = 3, tie_head: bool = True,
               samples: int = 64) -> ModelSpec:
    """Parameters shared by layers: one Tanh block used by `repeats` consecutive layers (ALBERT's sharing), between
    an input layer and, with `tie_head`, a head of the input layer's weight (d_in classes); else its own head."""
    torch.manual_seed(3)
    inp, block = nn.Linear(d_in, hidden), Tanh(hidden)
    head: nn.Module = TiedHead(inp) if tie_head else nn.Linear(hidden, d_in)
    layers: list[nn.Module] = [nn.Sequential(inp, nn.Tanh()), *[block] * repeats, Tanh(hidden), head]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(samples, d_in - 1, d_in))


class Repeat(nn.Module):
    """Its input repeated `k` times along the features: no parameters, and its backward keeps nothing."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, self.k)


class ChunkMean(nn.Module):
    """The mean of `k` equal chunks of the features: its backward keeps nothing either."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], self.k, -1).mean(dim=1)


class Project(nn.Module):
    """x @ proj, a fixed (non-persistent) buffer its backward keeps, then a trainable Linear."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("proj", torch.randn(d, d) / d**0.5, persistent=False)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x @ self.proj))


def memory_mlp(d: int = 16, k: int = 64, frozen: int = 1, classes: int = 3, samples: int = 64) -> ModelSpec:
    """For the planner's memory: Linear layers, the first `frozen` of them frozen (a fine-tuned backbone), then a
    layer whose output is `k` times its input and one that takes it back (neither keeps anything for its
    backward: a stage holds that wide tensor only as its boundary), a layer with a buffer, and a head."""
    torch.manual_seed(5)
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(d, d), nn.Tanh()) for i in range(frozen + 1)]
    for layer in layers[:frozen]:
        layer.requires_grad_(False)
    layers += [Repeat(k), ChunkMean(k), Project(d), nn.Linear(d, classes)]
    return ModelSpec(layers=layers, loss_fn=F.cross_entropy, dataset=_data(samples, d - 1, classes))
