"""Host overheads out of the hot loop (issue 15): the non-finite check without host syncs, staged inputs,
cached signatures, cheap spans; MFU."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

from pipeflow.failure import NonFiniteError
from pipeflow.guard import StepGuard
from pipeflow.signals import SignalStop


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Every Tensor method that reads a value back to Python raises: on a GPU each would be a device sync."""
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a tensor value was read on the host")

    names = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _guard(*, flush: bool, skip: bool, losses: list[torch.Tensor] | None = None) -> tuple[StepGuard, torch.nn.Parameter,
                                                                                      torch.optim.Optimizer]:
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = torch.optim.Adam([w], lr=0.1, fused=True)
    stage = SimpleNamespace(parameters=lambda: [w], last=losses is not None)
    engine = SimpleNamespace(S=1, s=0, actions=[], optimizer=opt, stage=stage, losses=[] if losses is None else losses,
                             world=SimpleNamespace(device=torch.device("cpu")))
    guard = StepGuard(engine, MPI.COMM_SELF, SignalStop(), skip_nonfinite=skip, agree_every_step=flush)
    assert guard.lagged is False  # a CPU rank checks synchronously; a CUDA rank with a fused optimizer lags:
    guard.lagged = True
    return guard, w, opt


@pytest.mark.parametrize("skip", [False, True])
def test_async_lagged_guard_skips_on_the_device_exactly_and_settles_an_update_later(skip, caplog):
    """Asynchronous schedules on GPUs: the fused optimizer skips a non-finite update itself (parameters
    AND optimizer state unchanged); the host learns it at the next STEP, without reading the device then."""
    guard, w, opt = _guard(flush=False, skip=skip)
    grads = [1.0, float("nan"), 1.0, 1.0]
    for step, g in enumerate(grads):
        before = w.detach().clone()
        state = {k: v.clone() for k, v in opt.state[w].items()} if opt.state[w] else None
        w.grad = torch.full((3,), g, dtype=torch.float64)
        if step == 2 and not skip:
            with pytest.raises(NonFiniteError, match="non-finite gradients at update 2 on stage 0; the update was "
                                                     "not applied"):
                guard()
            return
        with no_host_reads():
            assert guard() is True
            opt.step()
        moved = not torch.equal(w.detach(), before)
        assert moved == (g == 1.0), f"update {step + 1} must be skipped exactly when non-finite"
        if g != 1.0:
            assert state is not None and all(torch.equal(opt.state[w][k], v) for k, v in state.items())
    guard.flush_pending()
    assert guard.skipped == [1] and guard.consecutive == 0
    assert "non-finite gradients at update 2 on stage 0: skipped (--skip-nonfinite)" in caplog.text


def test_lagged_flush_guard_reads_no_tensor_on_the_host_and_sees_the_loss():
    """Flush schedules on GPUs: one multi-tensor check of the gradients plus the losses, no host read;
    a non-finite loss alone (finite gradients) skips the update on the device too."""
    losses: list[torch.Tensor] = []
    guard, w, opt = _guard(flush=True, skip=False, losses=losses)
    for step, loss in enumerate([1.0, float("inf"), 2.0]):
        before = w.detach().clone()
        losses.append(torch.tensor(loss))
        w.grad = torch.ones(3, dtype=torch.float64)
        with no_host_reads():
            guard()
            opt.step()
        assert (not torch.equal(w.detach(), before)) == (loss != float("inf"))
    assert guard.stop_reason is not None and "non-finite loss on stage 0 (the last) at step 2" in guard.stop_reason


def test_multi_tensor_check_finds_one_bad_value_among_many_and_leaves_gradients_unchanged():
    ws = [torch.nn.Parameter(torch.randn(n, dtype=dt)) for n, dt in [(5, torch.float64), (7, torch.float32),
                                                                      (3, torch.float64)]]
    stage = SimpleNamespace(parameters=lambda: ws, last=False)
    engine = SimpleNamespace(S=1, s=0, actions=[], optimizer=torch.optim.SGD(ws, lr=0.1), stage=stage, losses=[],
                             world=SimpleNamespace(device=torch.device("cpu")))
    guard = StepGuard(engine, MPI.COMM_SELF, SignalStop(), skip_nonfinite=True, agree_every_step=False)
    for w in ws:
        w.grad = torch.randn_like(w)
    before = [w.grad.clone() for w in ws]
    assert guard._local_check() == (False, False)
    assert all(torch.equal(w.grad, b) for w, b in zip(ws, before))
    ws[1].grad[4] = float("-inf")
    assert guard._local_check() == (True, False)
