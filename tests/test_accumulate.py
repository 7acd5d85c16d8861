"""Gradient accumulation inside the weight GEMM (pipeflow/split.py, PIPEFLOW_GRAD_ACCUM=gemm): every microbatch of a
step but the first adds its nn.Linear weight gradients into .grad with the GEMM itself; gradients equal autograd's,
hooks still see every microbatch, a replica reducer still overlaps its all-reduce with the last backward."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeflow import config, split
from pipeflow.api import Pipeline
from pipeflow.split import WeightGradStore, install
from tests import api_user_loop
from tests.conftest import Case, MpiRun, base_env, batched, in_background
from tests.reference import reference_flush
from tests.test_split import Mixed, _grads, _loss

GPT = {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256}


@pytest.fixture
def gemm_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each split.accumulate_into call did: True where the GEMM accumulated."""
    calls: list[bool] = []
    real = split.accumulate_into

    def spy(weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor) -> bool:
        calls.append(real(weight, x, grad_out))
        return calls[-1]

    monkeypatch.setattr(split, "accumulate_into", spy)
    return calls


@pytest.mark.parametrize("knob", ["gemm", "autograd", None])
def test_a_pipeline_accumulates_linear_weight_gradients_in_the_gemm_unless_told_not_to(
        monkeypatch: pytest.MonkeyPatch, gemm_calls: list[bool], knob: str | None) -> None:
    if knob is None:
        monkeypatch.delenv("PIPEFLOW_GRAD_ACCUM", raising=False)  # the default: autograd
    else:
        monkeypatch.setenv("PIPEFLOW_GRAD_ACCUM", knob)
    want, _ = api_user_loop.reference()
    m = 4
    with Pipeline(api_user_loop.model(), F.cross_entropy, schedule="1f1b", microbatches=m, device="cpu",
                  optimizer=lambda p: torch.optim.SGD(p, lr=api_user_loop.LR)) as pipe:
        linears = sum(isinstance(x, nn.Linear) for x in pipe.engine.stage.module.modules())
        for x, y in api_user_loop.batches():
            pipe.step(x, target=y)
        got = pipe.state_dict()
    assert got is not None and linears == 4
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14)
    steps = len(api_user_loop.batches())
    if knob != "gemm":
        assert gemm_calls == []
    else:  # each step: the first microbatch's gradients are autograd's new tensors, the other m - 1 add in the GEMM
        assert gemm_calls.count(True) == steps * (m - 1) * linears
        assert gemm_calls.count(False) == steps * linears


def test_gemm_accumulation_equals_autograd_and_leaves_hooked_weights_to_autograd(gemm_calls: list[bool]) -> None:
    torch.manual_seed(0)
    plain = Mixed().double()
    fused = copy.deepcopy(plain)
    install(fused, WeightGradStore(fuse=True))
    seen = {"fc": 0, "twice": 0}
    fused.fc.weight.register_post_accumulate_grad_hook(lambda p: seen.__setitem__("fc", seen["fc"] + 1))
    fused.twice.weight.register_hook(lambda g: seen.__setitem__("twice", seen["twice"] + 1))
    for seed in (1, 2, 3):
        _loss(plain, seed)[0].backward()
        _loss(fused, seed)[0].backward()
    for name, g in _grads(plain).items():
        torch.testing.assert_close(_grads(fused)[name], g, rtol=1e-12, atol=1e-14, msg=name)
    # Hooked weights went through autograd each microbatch (twice's two uses summed first, as autograd does).
    assert seen == {"fc": 3, "twice": 3}
    # Per microbatch, in backward order: head (the tied embedding weight), fc; twice, whose weight has a gradient
    # hook, runs plain F.linear (split.py). head added in the GEMM from the second microbatch on (its gradient
    # existed); fc, whose post-accumulate hook observes the accumulation, never did.
    assert gemm_calls == [False] * 2 + [True, False] * 2


def test_zero_bubble_w_adds_in_the_gemm_once_gradients_exist(gemm_calls: list[bool]) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    plain = copy.deepcopy(net)
    store = WeightGradStore(fuse=True)
    install(net, store)
    xs = [torch.randn(5, 6, dtype=torch.float64) for _ in range(3)]
    for mb, x in enumerate(xs):
        plain(x).square().sum().backward()
        with store.defer(mb):
            net(x).square().sum().backward()
        assert net[0].weight.grad is None or mb > 0
        store.flush(mb)
    for name, g in _grads(plain).items():
        torch.testing.assert_close(_grads(net)[name], g, rtol=1e-12, atol=1e-14, msg=name)
    assert gemm_calls == [False, False, True, True, True, True]


def test_an_armed_reducer_overlaps_its_buckets_with_gemm_accumulation(one_rank_group, gemm_calls: list[bool]) -> None:
    """Between arms the reducer holds no hooks, so the GEMMs accumulate; the armed (last) backward goes through
    autograd's AccumulateGrad, whose hooks launch every bucket during that backward."""
    from pipeflow.reduce import GradReducer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    plain = copy.deepcopy(net)
    install(net, WeightGradStore(fuse=True))
    red = GradReducer(list(net.parameters()), one_rank_group, bucket_bytes=1)
    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]
    for x in xs[:2]:
        net(x).sum().backward()
        plain(x).sum().backward()
    assert gemm_calls == [False, False, True, True]
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    loss = net(xs[2]).sum()
    red.arm([loss])
    loss.backward()
    plain(xs[2]).sum().backward()
    assert [b for _, _, b, _, _ in red.works] == [0, 1, 2, 3]  # launched in the backward, not in finish()
    assert gemm_calls[4:] == [False, False]  # hooked while armed: autograd's accumulation
    red.finish()
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    for name, g in _grads(plain).items():
        torch.testing.assert_close(_grads(net)[name], g, rtol=1e-12, atol=1e-14, msg=name)


def test_the_accumulation_knob_is_checked_with_one_line() -> None:
    assert split.gemm_accumulation({}) is False and split.gemm_accumulation({"PIPEFLOW_GRAD_ACCUM": "gemm"}) is True
    # unset, the plan's choice; set, the knob wins over it
    assert split.gemm_accumulation({}, planned="gemm") is True and split.gemm_accumulation({}, planned=None) is False
    assert split.gemm_accumulation({"PIPEFLOW_GRAD_ACCUM": "autograd"}, planned="gemm") is False
    with pytest.raises(config.ConfigError, match=r"^PIPEFLOW_GRAD_ACCUM must be one of autograd, gemm, found "
                                                 r"'fused'$"):
        config.check_environment({"PIPEFLOW_GRAD_ACCUM": "fused"})


@in_background
def test_pipeflow_profile_refuses_an_unknown_accumulation_before_any_work(tmp_path) -> None:
    cmd = [sys.executable, "-m", "partitioner.profiler", "--model", "mlp", "--microbatch-size", "2", "-o",
           str(tmp_path / "p.json")]
    proc = subprocess.run(cmd, env={**base_env(), "PIPEFLOW_GRAD_ACCUM": "fast"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "PIPEFLOW_GRAD_ACCUM must be one of autograd, gemm, found 'fast'")
    assert not (tmp_path / "p.json").exists()


def test_the_profiler_times_the_split_of_a_layer_that_accumulates_in_the_gemm_and_keeps_it() -> None:
    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    store = WeightGradStore(fuse=True)
    install(layer, store)
    times = split.time_split_backward(layer, torch.randn(4, 8, dtype=torch.float64),
                                      lambda fn: float(fn() is None), warmup=0, repeats=1)
    assert times == (1.0, 1.0)
    assert all(type(m) is split.SplitLinear and m.__dict__["_split_store"] is store for m in (layer[0], layer[2]))


def replicated_gemm(d: Path) -> Case:
    """1f1b on 2 stages x 2 replicas with the GEMMs accumulating, as the plan says (pipeflow-plan's choice,
    partitioner/accumulation.py): the reducer's last backward overlaps."""
    plan = {"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 4, "workers": 4, "accumulation": "gemm",
            "stages": [{"layers": [0, 2], "replicas": 2, "ranks": [0, 1]},
                       {"layers": [2, 4], "replicas": 2, "ranks": [2, 3]}]}
    (d / "plan.json").write_text(json.dumps(plan))
    return Case(4, ["--model", "gpt", "--model-args", json.dumps(GPT), "--plan", str(d / "plan.json"),
                    "--steps", "3", "--microbatch-size", "2", "--optimizer", "sgd", "--lr", "0.05",
                    "--momentum", "0.9", "--dtype", "float64", "--device", "cpu", "--save", str(d / "model.pt")],
                env={"PIPEFLOW_LOG": "INFO"})


@batched(replicated_gemm)
def test_replicated_1f1b_accumulating_in_the_gemm_equals_single_process(mpi: MpiRun) -> None:
    # Each rank: its blocks' 4 nn.Linear modules (stage 0: 1 block; stage 1: 1 block and the head's).
    assert mpi.proc.stderr.count("1f1b: 4 nn.Linear module(s) add their weight gradients into .grad inside the "
                                 "GEMM (gemm accumulation)") == 2
    assert mpi.proc.stderr.count("1f1b: 5 nn.Linear module(s) add their weight gradients") == 2
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("gpt", GPT, steps=3, microbatches=4, microbatch_size=2, optimizer="sgd", lr=0.05,
                           momentum=0.9)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=k)
