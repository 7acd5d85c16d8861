"""CUDA's lazy module loading deadlocks pipelined NCCL ranks (pipeflow/cudaenv.py): pipeflow-train asks for eager
loading before its first CUDA call, keeps a mode the user chose, and warns when CUDA came up lazy before it."""
from __future__ import annotations

from unittest import mock

import torch

from pipeflow.cudaenv import eager_cuda_modules


def test_unset_becomes_eager_before_cuda_starts():
    env: dict[str, str] = {}
    with mock.patch.object(torch.cuda, "is_initialized", return_value=False):
        assert eager_cuda_modules(env) is None
    assert env == {"CUDA_MODULE_LOADING": "EAGER"}


def test_a_mode_the_user_chose_is_kept():
    for mode in ("LAZY", "EAGER"):
        env = {"CUDA_MODULE_LOADING": mode}
        with mock.patch.object(torch.cuda, "is_initialized", return_value=False):
            assert eager_cuda_modules(env) is None
        assert env == {"CUDA_MODULE_LOADING": mode}


def test_cuda_already_up_lazily_is_warned_about():
    for env in ({}, {"CUDA_MODULE_LOADING": "lazy"}):
        before = dict(env)
        with mock.patch.object(torch.cuda, "is_initialized", return_value=True):
            warning = eager_cuda_modules(env)
        assert warning is not None and "set CUDA_MODULE_LOADING=EAGER before the first CUDA call" in warning
        assert env == before  # too late to change: CUDA reads it at start-up
    with mock.patch.object(torch.cuda, "is_initialized", return_value=True):
        assert eager_cuda_modules({"CUDA_MODULE_LOADING": "EAGER"}) is None


def test_pipeflow_train_sets_eager_loading_first(monkeypatch):
    """train.main sets it before anything else runs (run() stubbed, as in test_fuzz): planning on the spot profiles
    on the GPU before the process group exists, so init_world alone would be too late."""
    from pipeflow import train

    monkeypatch.setenv("CUDA_MODULE_LOADING", "unset at teardown")  # records the original state to restore
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    seen: dict[str, str | None] = {}

    def fake_run(*args, **kwargs):
        import os

        seen["mode"] = os.environ.get("CUDA_MODULE_LOADING")
        return 0

    with mock.patch.object(train, "run", side_effect=fake_run), \
            mock.patch.object(torch.cuda, "is_initialized", return_value=False):
        code = train.main(["--model", "mlp", "--model-args", '{"layers": 3, "samples": 16}',
                           "--layers-per-stage", "even", "--steps", "1"])
    assert code == 0
    assert seen == {"mode": "EAGER"}
