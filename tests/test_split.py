"""The B/W split of zero-bubble schedules (pipeflow/split.py), pure: gradients equal plain autograd's, B leaves the
nn.Linear weight gradients to W and does not run their GEMMs, the other layers keep the fused backward."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipeflow.split import SplitLinear, WeightGradStore, install, split_report, time_split_backward, uninstall
from pipeflow.stage import Stage


class Mixed(nn.Module):
    """Linear, LayerNorm, Conv1d, an embedding, nn.MultiheadAttention (its out_proj used through its weight), a
    Linear applied twice and a Linear whose weight is the embedding's (a tie inside the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.twice = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = self.ln(torch.tanh(self.fc(x)) + self.emb(tokens))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.head(self.twice(torch.tanh(self.twice(h))))


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 5, 8, generator=g, dtype=torch.float64).requires_grad_(True),
            torch.randint(0, 11, (3, 5), generator=g))


def _loss(model: nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, tokens = _inputs(seed)
    return model(x, tokens).square().mean(), x


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_split_gradients_equal_plain_autograd_and_b_leaves_linear_weights_to_w():
    torch.manual_seed(0)
    plain = Mixed().double()
    split = copy.deepcopy(plain)
    store = WeightGradStore()
    assert install(split, store) == ["fc", "twice", "head"]  # head's weight is the embedding's: split too
    assert type(split.head) is SplitLinear and type(split.mha.out_proj) is not SplitLinear
    for seed in (1, 2):  # two microbatches accumulate
        loss, x = _loss(plain, seed)
        loss.backward()
    want = _grads(plain)
    xs = []
    for mb, seed in enumerate((1, 2)):
        loss, x = _loss(split, seed)
        with store.defer(mb):
            loss.backward()
        xs.append(x)
    got = _grads(split)
    # B: the input gradient, biases and every fused layer's gradients; the split Linear weights wait for W.
    assert got["fc.weight"] is None and got["twice.weight"] is None
    for name in ("fc.bias", "ln.weight", "ln.bias", "conv.weight", "conv.bias", "mha.in_proj_weight",
                 "mha.out_proj.weight", "mha.out_proj.bias"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14, msg=name)
    # The tied weight: the embedding's share came in B; the head's comes with W.
    assert not torch.allclose(got["emb.weight"], want["emb.weight"])
    assert [p is split.fc.weight for p in store.weights(0)].count(True) == 1 and len(store.weights(0)) == 3
    store.flush(1)
    store.flush(0)
    assert not store.pending
    got = _grads(split)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-12, atol=1e-14, msg=name)
    uninstall(split)
    assert type(split.fc) is nn.Linear and "_split_store" not in split.fc.__dict__
    assert list(split.state_dict()) == list(plain.state_dict())


def test_outside_a_b_the_split_linear_backward_is_fused():
    torch.manual_seed(0)
    plain = Mixed().double()
    split = copy.deepcopy(plain)
    install(split, WeightGradStore())
    _loss(plain, 1)[0].backward()
    _loss(split, 1)[0].backward()  # no defer: the weight gradient comes at once
    for name, g in _grads(plain).items():
        torch.testing.assert_close(_grads(split)[name], g, rtol=1e-12, atol=1e-14, msg=name)


def test_b_does_not_run_the_weight_gemms():
    """A stack of Linears: the fused backward runs two GEMMs per layer (input and weight gradients), B only
    the input's and W only the weight's, as many FLOPs each."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(4)]).double()
    x = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)

    def flops(fn) -> int:
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    y = net(x).sum()
    fused = flops(y.backward)
    store = WeightGradStore()
    install(net, store)
    y = net(x).sum()

    def b() -> None:
        with store.defer(0):
            y.backward()

    b_flops = flops(b)
    assert all(layer.weight.grad is not None for layer in net)  # from the fused run above
    w_flops = flops(lambda: store.flush(0))
    assert fused == 4 * 2 * (2 * 16 * 32 * 32)
    assert b_flops == w_flops == fused // 2


def test_stage_split_backward_defers_to_backward_weights():
    """Stage API: linear_backward(split=True) installs the split, backward(i) is B, backward_weights(i) W."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6)), nn.Linear(6, 3)]
    ref = copy.deepcopy(layers)
    stage = Stage(layers, start=0, first=True, last=True, loss_fn=nn.functional.cross_entropy,
                  device=torch.device("cpu"), dtype=torch.float64)
    assert stage.linear_backward(split=True, fuse=False) == ["0.0", "1"]
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    stage.forward(0, x, y)
    stage.backward(0, None)
    weights = [stage.module[0][0].weight, stage.module[1].weight]
    assert all(p.grad is None for p in weights) and stage.module[0][1].weight.grad is not None
    assert {id(p) for p in stage.deferred_weights(0)} == {id(p) for p in weights}
    stage.backward_weights(0)
    net = nn.Sequential(*ref).double()
    nn.functional.cross_entropy(net(x), y).backward()
    for (name, p), q in zip(stage.module.named_parameters(), net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_split_report_and_builtin_gpt():
    """Which layers of the built-in gpt split: the blocks' qkv/proj/fc/out and the head's lm; the embeddings and
    LayerNorms keep the fused backward."""
    from pipeflow.spec import build_model

    spec = build_model("gpt", {"layers": 1, "d_model": 8, "heads": 2, "seq_len": 4})
    reports = [split_report(layer) for layer in spec.layers]
    assert reports == [([], ["tok", "pos"]), (["qkv", "proj", "fc", "out"], ["ln1", "ln2"]), (["lm"], ["ln"])]
    assert split_report(nn.MultiheadAttention(8, 2)) == ([], ["", "out_proj"])


def test_time_split_backward_leaves_the_layer_as_it_was():
    layer = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    b_ms, w_ms = time_split_backward(layer, x, lambda fn: (fn(), 1.5)[1], warmup=1, repeats=2)
    assert (b_ms, w_ms) == (1.5, 1.5)
    assert all(type(m) is not SplitLinear for m in layer.modules()) and all(p.grad is None for p in layer.parameters())
    assert time_split_backward(nn.LayerNorm(8), x, lambda fn: (fn(), 1.0)[1], warmup=0, repeats=1) is None


@pytest.mark.parametrize("autocast", [False, True])
def test_autocast_and_no_grad_fall_back(autocast):
    layer = nn.Linear(4, 4)
    store = WeightGradStore()
    install(layer, store)
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    with store.defer(0):
        y.float().sum().backward()
    assert (layer.weight.grad is not None) is autocast  # under autocast the backward stays fused
    with torch.no_grad():
        assert layer(x).grad_fn is None


class Smooth(nn.Module):
    """Twice differentiable throughout (Mixed's attention is not): a Linear, a LayerNorm, a Linear applied twice
    and a head tied to the first Linear's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.twice = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.fc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(torch.tanh(self.fc(x)))
        return self.head(torch.tanh(self.twice(torch.tanh(self.twice(h)))))


def _penalised(model: nn.Module, x: torch.Tensor,
               store: WeightGradStore | None = None) -> dict[str, torch.Tensor | None]:
    """The gradients of a loss holding its own input gradient (a gradient penalty, a physics-informed loss):
    a backward through the backward (create_graph). With `store`, the outer backward is a B and its W."""
    x = x.detach().requires_grad_(True)
    y = model(x).square().mean()
    (gx,) = torch.autograd.grad(y, x, create_graph=True)
    with store.defer(0) if store is not None else contextlib.nullcontext():
        (y + gx.square().sum()).backward()
    if store is not None:
        store.flush(0)
    return _grads(model)


@pytest.mark.parametrize("how", ["fused", "gemm", "b and w"])
def test_split_linears_differentiate_twice_as_nn_linear_does(how):
    plain = Smooth().double()
    split = copy.deepcopy(plain)
    store = WeightGradStore(fuse=how == "gemm")
    install(split, store)
    x = _inputs(3)[0]
    for _ in range(2):  # the second adds into .grad: with gemm, where the GEMM could if grad mode were off
        want = _penalised(plain, x)
        for name, g in _penalised(split, x, store if how == "b and w" else None).items():
            torch.testing.assert_close(g, want[name], rtol=1e-12, atol=1e-12)


def test_torch_func_differentiates_installed_linears_natively():
    plain = Mixed().double()
    split = copy.deepcopy(plain)
    install(split, WeightGradStore(fuse=True))
    x, tokens = _inputs(4)

    def loss(model: nn.Module, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x, tokens)).square().mean()

    want = torch.func.grad(lambda p: loss(plain, p))(dict(plain.named_parameters()))
    got = torch.func.grad(lambda p: loss(split, p))(dict(split.named_parameters()))
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-12, atol=1e-12)


class Workspace(nn.Module):
    """A Linear whose input is a buffer every forward overwrites in place (a workspace), and one on its input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.lin2, self.buf = nn.Linear(4, 3), nn.Linear(4, 3), torch.zeros(2, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf.copy_(x.detach())
        return self.lin(self.buf) + self.lin2(x)


def test_w_refuses_an_input_changed_in_place_after_its_forward():
    """zb's order F0 B0 F1 W0: the next forward overwrote microbatch 0's workspace, whose data W0 would read (it
    trained on microbatch 1's data, silently); now W stops as autograd stops a backward that needs a changed
    tensor. Without the change between B and W it trains as plain autograd."""
    torch.manual_seed(0)
    plain, split = Workspace().double(), Workspace().double()
    split.load_state_dict(plain.state_dict())
    store = WeightGradStore()
    install(split, store)
    xs = [torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    with store.defer(0):
        split(xs[0]).square().sum().backward()
    store.flush(0)  # W right after B: nothing changed in between
    plain(xs[0]).square().sum().backward()
    assert torch.equal(split.lin.weight.grad, plain.lin.weight.grad)
    with store.defer(1):
        split(xs[1]).square().sum().backward()
    split(xs[0])  # the next microbatch's forward, before W1
    with pytest.raises(RuntimeError, match="modified by an inplace operation: the input of an nn.Linear "
                                           r"\(weight \(3, 4\)\), at version 3; expected version 2"):
        store.flush(1)


def test_a_weight_with_a_gradient_hook_keeps_its_gradient_in_b():
    """A pruning mask on a weight's gradient (weight.register_hook): under a deferred B the hook was called with
    None (a TypeError in the user's hook, a traceback); the Linear now takes the fused backward in B, its hook sees
    the whole gradient and the result is plain autograd's."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    split = copy.deepcopy(plain)
    mask = (torch.arange(16).reshape(4, 4) % 3 != 0).double()
    for model in (plain, split):
        model[0].weight.register_hook(lambda g: g * mask)
    store = WeightGradStore()
    install(split, store)
    x = torch.randn(5, 4, dtype=torch.float64)
    with store.defer(0):
        split(x).square().sum().backward()
    assert [p.shape for p in store.weights(0)] == [torch.Size([2, 4])]  # the unhooked Linear's weight waits for W
    store.flush(0)
    plain(x).square().sum().backward()
    for a, b in zip(plain.parameters(), split.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert (split[0].weight.grad[mask == 0] == 0).all()
