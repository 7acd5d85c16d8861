"""Sparse gradients (nn.Embedding(sparse=True)) train as in one process: the non-finite check reads their values
(pipeflow/tensorops.py), a replicated stage sums them dense (pipeflow/reduce.py). Before, every run stopped at the
first STEP: "Could not run 'aten::_amp_foreach_non_finite_check_and_unscale_' with arguments from the 'SparseCPU'
backend", and a replicated stage's all-reduce with "reshape is not implemented for sparse tensors"."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pipeflow.data.loader import MicrobatchLoader
from pipeflow.runner import fused_step, sparse_gradients
from pipeflow.spec import build_model
from pipeflow.tensorops import nonfinite_flag
from tests.conftest import Case, MpiRun, batched, write_plan
from tests.test_seams_grads import assert_same, saved

MODEL = "tests.models_grads:sparse_embedding"
STEPS, M, B = 3, 4, 2


def reference(raw: bool = False) -> dict[str, torch.Tensor]:
    """One process, float64, SGD with momentum on the sparse gradient, the mean of m microbatch losses."""
    spec = build_model(MODEL, {"raw": raw}, seed=0)
    net = nn.Sequential(*spec.layers).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loader = MicrobatchLoader(spec.dataset, B, seed=0)
    for k in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for i in range(M):
            x, y = loader.microbatch(k * M + i)
            (spec.loss_fn(net(x), y) / M).backward()
        assert net[0].embed.weight.grad.is_sparse
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_the_check_reads_a_sparse_gradient_s_values() -> None:
    dense = torch.zeros(3, dtype=torch.float64)
    good = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (5,), dtype=torch.float64, check_invariants=True)
    # one index twice: finite values whose sum, what the optimizer applies, is inf
    bad = torch.sparse_coo_tensor([[1, 1]], [1e308, 1e308], (5,), dtype=torch.float64, check_invariants=True)
    assert float(nonfinite_flag([dense, good], torch.device("cpu"))) == 0.0
    assert float(nonfinite_flag([dense, bad], torch.device("cpu"))) == 1.0


def sparse_runs(d: Path, replicas: int, raw: bool, schedule: str) -> Case:
    np_ = write_plan(d / "plan.json", schedule, M, [(1, replicas), (3 if raw else 2, 1)])
    return Case(np_, ["--model", MODEL, "--model-args", json.dumps({"raw": raw}), "--plan", str(d / "plan.json"),
                      "--steps",
                      str(STEPS), "--microbatch-size", str(B), "--dtype", "float64", "--device", "cpu", "--optimizer",
                      "sgd", "--lr", "0.1", "--momentum", "0.9", "--save", str(d / "model.pt")])


@pytest.mark.parametrize(("replicas", "raw", "schedule"), [(1, False, "1f1b"), (2, False, "1f1b"), (1, True, "1f1b"),
                                                        (2, True, "1f1b"), (1, True, "zb")])
@batched(sparse_runs)
def test_a_sparse_embedding_trains_as_in_one_process(mpi: MpiRun, replicas: int, raw: bool, schedule: str) -> None:
    """`raw`: the embeddings cross to the next stage, and the gradient received for them becomes the sparse
    gradient's values without a copy: its receive buffer must not serve a later microbatch (bufpool.py)."""
    assert_same(saved(mpi), reference(raw))


def test_a_gpu_run_with_sparse_gradients_steps_unfused() -> None:
    """pipeflow-train's optimizers are fused on GPUs (one kernel a step), and torch's fused SGD refuses sparse
    gradients: a model that makes them gets the unfused step."""
    on_gpu, on_cpu = [SimpleNamespace(is_cuda=True)], [SimpleNamespace(is_cuda=False)]
    assert fused_step(on_gpu, sparse=False) and not fused_step(on_gpu, sparse=True)
    assert not fused_step(on_cpu, sparse=False) and not fused_step([], sparse=False)
    assert sparse_gradients(build_model(MODEL, {}).layers)
    assert not sparse_gradients([nn.Embedding(3, 2), nn.Linear(2, 2)])
    assert sparse_gradients([nn.Sequential(nn.EmbeddingBag(3, 2, sparse=True))])
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):  # what the fused step does
        e = nn.Embedding(3, 2, sparse=True)
        e(torch.tensor([1])).sum().backward()
        torch.optim.SGD(e.parameters(), lr=0.1, fused=True).step()
