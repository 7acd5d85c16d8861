"""Host overheads out of the hot loop (issue 15): the non-finite check without host syncs, staged inputs,
cached signatures, cheap spans; MFU."""
from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

from pipeflow.failure import NonFiniteError
from pipeflow.guard import StepGuard
from pipeflow.signals import SignalStop
from tests.conftest import Case, MpiRun, batched


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
    engine = SimpleNamespace(S=1, s=0, actions=[], update=SimpleNamespace(checking=None),  # no late update
                             optimizer=opt, stage=stage, losses=[] if losses is None else losses,
                             world=SimpleNamespace(device=torch.device("cpu")), parameters=stage.parameters,
                             holds_last=stage.last)
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


def test_lagged_guard_reuses_its_flag_buffers():
    """The lagged check copies each STEP's flags into a host buffer (pinned on a GPU) and settles it a STEP later:
    a settled buffer is reused, so however many STEPs run, two buffers exist and none is allocated per STEP."""
    guard, w, opt = _guard(flush=False, skip=True)
    seen: dict[int, torch.Tensor] = {}  # the buffers themselves are kept, so that no id is reused
    for _ in range(6):
        w.grad = torch.ones(3, dtype=torch.float64)
        assert guard() is True
        opt.step()
        seen.update((id(host), host) for _, host, _ in guard.pending)
    guard.flush_pending()
    assert len(seen) == 2 and guard.skipped == []


def test_lagged_flush_guard_reads_no_tensor_on_the_host_and_sees_the_loss():
    """Flush schedules on GPUs: one multi-tensor check of the gradients plus the losses, no host read;
    a non-finite loss alone (finite gradients) skips the update on the device too."""
    losses: list[torch.Tensor] = []
    guard, w, opt = _guard(flush=True, skip=False, losses=losses)
    for loss in [1.0, float("inf"), 2.0]:
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
    engine = SimpleNamespace(S=1, s=0, actions=[], update=SimpleNamespace(checking=None),  # no late update
                             optimizer=torch.optim.SGD(ws, lr=0.1), stage=stage, losses=[],
                             world=SimpleNamespace(device=torch.device("cpu")), parameters=stage.parameters,
                             holds_last=False)
    guard = StepGuard(engine, MPI.COMM_SELF, SignalStop(), skip_nonfinite=True, agree_every_step=False)
    for w in ws:
        w.grad = torch.randn_like(w)
    before = [w.grad.clone() for w in ws]
    assert guard._local_check() == (False, False)
    assert all(torch.equal(w.grad, b) for w, b in zip(ws, before))
    ws[1].grad[4] = float("-inf")
    assert guard._local_check() == (True, False)
    # bfloat16 (the GPU benchmark's dtype; AMP's check has no CUDA kernel for it): a NaN is found too
    ws[1].grad[4] = 0.0
    ws.append(torch.nn.Parameter(torch.randn(6, dtype=torch.bfloat16)))
    ws[-1].grad = torch.randn_like(ws[-1])
    assert guard._local_check() == (False, False)
    ws[-1].grad[2] = float("nan")
    assert guard._local_check() == (True, False)


def test_staged_microbatches_equal_the_per_microbatch_path_and_read_the_dataset_once_per_step():
    """stage_on: a minibatch's samples collated once; every microbatch equal to the unstaged loader's."""
    from torch.utils.data import Dataset

    from pipeflow.data.loader import MicrobatchLoader

    class Counting(Dataset):
        def __init__(self) -> None:
            self.reads = 0

        def __len__(self) -> int:
            return 37

        def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
            self.reads += 1
            return (torch.full((3,), float(i)), torch.tensor([i, -i])), i % 5

    plain, staged = MicrobatchLoader(Counting(), 4, seed=3), MicrobatchLoader(Counting(), 4, seed=3)
    staged.stage_on(torch.device("cpu"), 5)
    for j in range(23):  # crosses epochs (37 samples) and blocks
        (xa, ya), ta = plain.microbatch(j)
        (xb, yb), tb = staged.microbatch(j)
        for a, b in [(xa, xb), (ya, yb), (ta, tb)]:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert staged.dataset.reads == 5 * 4 * 5  # blocks 0..4, each read once: 5 microbatches of 4 samples
    reads = staged.dataset.reads
    assert staged.signature(7) == staged.signature(7) == plain.signature(7) == ((4, 3), (4, 2))
    assert staged.dataset.reads == reads + 1  # the signature is cached


def test_receive_buffers_are_reused_unless_an_output_aliases_them(monkeypatch):
    """P2P.release pools dead receive buffers; the next receive of that shape takes one instead of allocating.
    A buffer that an output passed through (maybe still being sent) is not pooled."""
    import pipeflow.comm as comm

    posted: list[torch.Tensor] = []
    monkeypatch.setattr(comm, "_batched", lambda op, bufs, peer, group: posted.extend(bufs) or ["work"])
    world = SimpleNamespace(rank=1, device=torch.device("cpu"), mpi=None)
    p2p = comm.P2P(world, {(0, 1, "F"): "group"})  # type: ignore[arg-type]
    meta = [((2, 3), torch.float32, True), ((4,), torch.int64, False)]
    (a, b), _ = p2p.recv(0, "F", meta=meta)
    a.requires_grad_(True)
    a.grad = torch.ones(2, 3)
    p2p.release([a, b], keep=[b[1:]])  # b is aliased by an output: the allocator keeps it
    (c, d), _ = p2p.recv(0, "F", meta=meta)
    assert c is a and d is not b and p2p.pool.reused == 1
    assert not c.requires_grad and c.grad is None
    kept = c.detach()  # a layer kept it (Transformer-XL's memory), or a gradient is a view of it: not pooled
    p2p.release([c, d], keep=[])
    (e, f), _ = p2p.recv(0, "F", meta=meta)
    assert e is not c and f is d and p2p.pool.reused == 2 and kept.data_ptr() == c.data_ptr()


def test_cuda_span_timer_reuses_its_events_and_never_syncs_between_reports(monkeypatch):
    """--trace on a GPU: each span is two CUDA events recorded on the stream; after a report (the only sync)
    the events are recorded again instead of created, and every time stays right."""
    from pipeflow.spans import SpanTimer

    clock = iter(range(1, 10**6))
    made: list[object] = []
    syncs: list[int] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            made.append(self)

        def record(self, stream: object = None) -> None:
            self.t = next(clock)

        def elapsed_time(self, other: Event) -> float:
            return float(other.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    timer = SpanTimer(torch.device("cpu"))
    timer.cuda = True
    timer.reset(0)
    created = []
    for window in range(3):
        syncs.clear()
        for step in range(2 * window, 2 * window + 2):
            for i in range(3):
                with timer.span("F", i):
                    pass
            timer.end_step(step)
        assert not syncs  # recording never syncs
        created.append(len(made))
        spans, steps = timer.resolve()
        assert len(spans) == 6 and all(s.end - s.start == pytest.approx(1e-3) for s in spans)  # 1 "ms" each
        assert [st for st, _, _ in steps] == [2 * window, 2 * window + 1]
        assert steps[0][2] == steps[1][1] and all(b > a for _, a, b in steps)  # a step begins where one ended
    assert created[2] == created[1] == created[0]  # windows 2 and 3 record the first window's events again


def test_point_to_point_goes_through_batched_ops_only(monkeypatch):
    """NCCL warns "an unbatched P2P op ... lazy initialization" at each group's first single send/recv; torch's
    pipelining avoids it with batch_isend_irecv, and so do sends, receives and the warm-up."""
    import pipeflow.comm as comm

    batches: list[list[tuple[object, tuple[int, ...], int]]] = []

    class Work:
        def wait(self) -> None: ...

        def is_completed(self) -> bool:
            return True

    def batch(ops: list[object]) -> list[Work]:
        batches.append([(op.op, tuple(op.tensor.shape), op.peer) for op in ops])  # type: ignore[attr-defined]
        return [Work()]

    def unbatched(*_: object, **__: object) -> None:
        raise AssertionError("an unbatched point-to-point op")

    monkeypatch.setattr(comm.dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(comm.dist, "P2POp", lambda op, tensor, peer, group: SimpleNamespace(op=op, tensor=tensor,
                                                                                          peer=peer, group=group))
    for name in ("send", "recv"):
        monkeypatch.setattr(comm.dist, name, unbatched)
    world = SimpleNamespace(rank=0, size=2, device=torch.device("cpu"), mpi=None)
    p2p = comm.P2P(world, {(0, 1, "F"): "gF", (1, 0, "B"): "gB"})  # type: ignore[arg-type]
    p2p.warm_up()
    p2p.send([torch.ones(2), torch.ones(3, 1)], 1, "F")
    p2p.recv(1, "B", meta=[((2,), torch.float32, False), ((3, 1), torch.float32, False)])
    assert batches == [[(comm.dist.isend, (1,), 1)], [(comm.dist.irecv, (1,), 1)],
                       [(comm.dist.isend, (2,), 1), (comm.dist.isend, (3, 1), 1)],
                       [(comm.dist.irecv, (2,), 1), (comm.dist.irecv, (3, 1), 1)]]


@pytest.mark.parametrize("granularity,kinds", [("sublayer", ["Attention", "MLP"]),
                                                ("fine", ["AttentionCore", "Projection", "Expand", "Contract"])])
def test_gpt_finer_layers_build_the_same_weights_and_outputs_as_blocks(granularity, kinds):
    """granularity "sublayer" (each block as Attention then MLP) and "fine" (four layers, two of whose outputs are
    the residual and the branch): the same parameters in the same order, and the same logits, so a plan may cut
    inside a block without changing the model."""
    from pipeflow.spec import build_model

    args = {"layers": 3, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256}
    block = build_model("gpt", args, seed=5)
    sub = build_model("gpt", {**args, "granularity": granularity}, seed=5)
    assert len(block.layers) == 5 and len(sub.layers) == 3 * len(kinds) + 2
    assert [type(m).__name__ for m in sub.layers[1:-1]] == kinds * 3
    for a, b in zip([p for m in block.layers for p in m.parameters()], [p for m in sub.layers for p in m.parameters()],
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    ya, yb = torch.nn.Sequential(*block.layers)(x), torch.nn.Sequential(*sub.layers)(x)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    assert block.flops_per_sample == sub.flops_per_sample
    with pytest.raises(Exception, match="granularity must be one of 'block', 'sublayer', 'fine', found 'head'"):
        build_model("gpt", {**args, "granularity": "head"})


def test_model_flops_per_sample_and_mfu():
    """PaLM's count: 6 N T + 12 L d T^2 per sequence (N: parameters that multiply, tied head once); mlp 6 N."""
    from pipeflow.mfu import mfu, peak_tflops
    from pipeflow.spec import build_model

    spec = build_model("gpt", {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256, "tie": True})
    blocks = 2 * (2 * 16 + 3 * 16 * 16 + 3 * 16 + 16 * 16 + 16 + 2 * 16 + 4 * 16 * 16 + 4 * 16 + 4 * 16 * 16 + 16)
    n = blocks + 2 * 16 + 256 * 16  # the head's LayerNorm and (tied) weight
    assert spec.flops_per_sample == 6 * n * 8 + 12 * 2 * 16 * 8 ** 2
    mlp = build_model("mlp", {"layers": 3, "d_in": 4, "hidden": 5, "classes": 2})
    assert mlp.flops_per_sample == 6 * ((4 * 5 + 5) + (5 * 5 + 5) + (5 * 2 + 2))
    assert mfu(100.0, 1e12, 4, 50.0) == pytest.approx(100 * 1e12 / (4 * 50e12))
    assert mfu(100.0, None, 4, 50.0) is None and mfu(100.0, 1e12, 4, None) is None
    assert peak_tflops(torch.device("cpu"), torch.float32) is None
    assert peak_tflops(torch.device("cpu"), torch.float32, 2.5) == 2.5


def test_profile_counts_the_loss():
    """The profile holds the loss's cost (a language model's fp32 cross-entropy costs like a block) as
    loss_ms, which the planner charges to the stage holding the last layer (costmodel, price)."""
    import time

    from partitioner.profiler import profile_model
    from pipeflow.spec import build_model

    spec = build_model("mlp", {"layers": 3, "d_in": 4, "hidden": 5, "classes": 2})
    plain = spec.loss_fn

    def slow_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return plain(out, target)

    spec.loss_fn = slow_loss
    prof = profile_model(spec, 4, warmup=0, repeats=1)
    assert prof.loss_ms is not None and prof.loss_ms >= 30
    assert all(layer.forward_ms < 30 for layer in prof.layers)


@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_steady_state_steps_read_no_tensor_on_the_host(schedule):
    """One single-stage engine in this process, the GPU configuration (fused Adam, the lagged check, staged
    inputs): after the first step, training steps read no tensor value back to Python, so on a GPU nothing
    in them waits for the device. The updates equal a plain loop's (exactness of the staged, lagged path)."""
    from partitioner.plan import Plan
    from pipeflow.comm import World
    from pipeflow.data.loader import MicrobatchLoader
    from pipeflow.engine import Engine
    from pipeflow.spec import build_model

    m, b = 2, 4
    plan = Plan.from_json({"format": "pipeflow.plan/1", "schedule": schedule, "microbatches": m, "workers": 1,
                           "stages": [{"layers": [0, 3], "replicas": 1, "ranks": [0]}]})
    spec = build_model("mlp", {"layers": 3, "d_in": 4, "hidden": 8, "classes": 3, "samples": 64})
    ref = torch.nn.Sequential(*[copy.deepcopy(layer) for layer in spec.layers]).double()
    loader = MicrobatchLoader(spec.dataset, b, seed=0)
    loader.stage_on(torch.device("cpu"), m)
    world = World(0, 1, 0, torch.device("cpu"), "gloo", MPI.COMM_SELF)
    engine = Engine(world, plan, spec, schedule=schedule, loader=loader, dtype=torch.float64, total_steps=3,
                    optimizer_factory=lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True))
    guard = StepGuard(engine, MPI.COMM_SELF, SignalStop(), skip_nonfinite=False, agree_every_step=engine.flush)
    guard.lagged = True
    engine.step_guard = guard
    if engine.flush:
        engine.train_step(0)
        with no_host_reads():
            engine.train_step(1)
            engine.train_step(2)
    else:
        engine.begin_segment(0, 1)
        engine.run(engine.actions)
        engine.begin_segment(1, 2)
        with no_host_reads():
            engine.run(engine.actions)
    guard.flush_pending()
    assert guard.skipped == []
    # the same updates in a plain loop: flush steps on the mean of m microbatches, async on each (1 stage)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    plain = MicrobatchLoader(spec.dataset, b, seed=0)
    for k in range(3):
        group = range(k * m, (k + 1) * m)
        for j in group:
            x, y = plain.microbatch(j)
            loss = spec.loss_fn(ref(x.double()), y)
            (loss / m if engine.flush else loss).backward()
            if not engine.flush:
                opt.step()
                opt.zero_grad()
        if engine.flush:
            opt.step()
            opt.zero_grad()
    for p, q in zip(ref.parameters(), engine.stage.parameters()):
        torch.testing.assert_close(p, q)


def test_peak_tflops_must_be_positive():
    from pipeflow.config import ConfigError
    from pipeflow.train import build_parser, check_args

    args = build_parser().parse_args(["--peak-tflops", "0"])
    with pytest.raises(ConfigError, match=r"^--peak-tflops must be > 0 TFLOP/s, found 0.0$"):
        check_args(args)
    check_args(build_parser().parse_args(["--peak-tflops", "989"]))


def test_tensors_between_stages_whose_shapes_follow_the_data_are_refused_in_one_line(monkeypatch):
    """A layer that keeps a data-dependent number of rows (x[mask]) sends other shapes for inputs of the same shapes:
    the receiver, told the shapes once per input signature, would post the wrong receive. Refused at that send as
    the model's error (structure.OutputError: one line, exit 2, train.py); before, a RuntimeError and its traceback,
    exit 1."""
    import pipeflow.comm as comm
    from pipeflow.structure import OutputError

    sent: list[bytes] = []
    monkeypatch.setattr(comm, "_batched", lambda op, bufs, peer, group: ["work"])
    mpi = SimpleNamespace(send=lambda data, dest, tag: sent.append(data))
    world = SimpleNamespace(rank=0, device=torch.device("cpu"), mpi=mpi)
    p2p = comm.P2P(world, {(0, 1, "F"): "group"})  # type: ignore[arg-type]
    monkeypatch.setattr(p2p, "_reap", lambda: None)
    p2p.send([torch.ones(4, 8, dtype=torch.float64)], 1, "F", signature=((4, 8),))
    p2p.send([torch.ones(4, 8, dtype=torch.float64)], 1, "F", signature=((4, 8),))  # the same: no new meta
    assert len(sent) == 1
    with pytest.raises(OutputError) as e:
        p2p.send([torch.ones(2, 8, dtype=torch.float64)], 1, "F", signature=((4, 8),))
    assert str(e.value) == (
        "the tensors sent to rank 1 changed from [(4, 8) float64] to [(2, 8) float64] (or their structure) "
        "for inputs of the same shapes ((4, 8),); what crosses a stage boundary must depend on the input's shapes "
        "only: keep a data-dependent shape, as x[mask], inside a stage, or pad it")


def late_peer(d: Path) -> Case:
    return Case(2, [str(d / "spent.json")], main="tests.quiet_ranks:main")


@batched(late_peer)
def test_a_rank_waiting_for_a_late_peer_leaves_the_core_to_others(mpi: MpiRun) -> None:
    """MPICH's blocking receive polls a core at 100% while it waits (its barrier about a third of one), so on a host
    with fewer free cores than ranks a rank waiting at an agreement or for a first message took the CPU from the rank
    it waited for. pipeflow.control's waits now sleep between polls: well under a fifth of the wait is CPU."""
    spent = json.loads((mpi.dir / "spent.json").read_text())
    assert set(spent) == {"recv", "allreduce_max", "allgather", "barrier"}
    for name, s in spent.items():
        assert s["wall"] > 0.4, (name, s)  # it did wait for the late rank
        assert s["cpu"] < 0.2 * s["wall"], (name, s)
