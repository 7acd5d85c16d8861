"""The copy-engine channel's protocol (pipeflow/celink.py) replayed in one process on a fake GPU: streams are
queues of operations, a scheduler runs whichever stream's next operation may run (a flag wait once its flag is
reached, an event wait once the event's record ran), "device memory" is host memory and copies are memmoves.
What is checked is what the real GPUs rely on: every message arrives intact in order whatever the host order of
sends and receives, the sender never overwrites a slot the receiver has not pulled, rings grow with the
messages, and a receive posted before its ring is known waits for its use."""
from __future__ import annotations

import ctypes
import random
import types
from typing import Any

import pytest
import torch

from pipeflow import celink, cesetup, config, cudadrv
from pipeflow.failure import UsageError
from tests.conftest import base_env, in_background


class Op:
    def __init__(self, ready: Any, do: Any = None) -> None:
        self.ready, self.do = ready, do


class FakeGPU:
    def __init__(self, seed: int) -> None:
        self.streams: dict[int, FakeStream] = {}
        self.current: FakeStream | None = None
        self.memory: list[Any] = []
        self.rng = random.Random(seed)

    def run(self) -> bool:
        """Run operations one at a time, each from a stream drawn at random among those whose next one may run
        (the streams' relative speeds are arbitrary); True when no stream has any left."""
        while True:
            ready = [s for s in self.streams.values() if s.ops and s.ops[0].ready()]
            if not ready:
                return not any(s.ops for s in self.streams.values())
            op = self.rng.choice(ready).ops.pop(0)
            if op.do:
                op.do()


class FakeStream:
    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu, self.ops = gpu, []
        self.cuda_stream = len(gpu.streams) + 1
        gpu.streams[self.cuda_stream] = self

    def wait_event(self, ev: FakeEvent) -> None:
        mark = ev.latest
        self.ops.append(Op(lambda: mark is None or mark["done"]))

    def wait_stream(self, other: FakeStream) -> None:
        ev = FakeEvent()
        ev.record(other)
        self.wait_event(ev)


class FakeEvent:
    def __init__(self) -> None:
        self.latest: dict[str, bool] | None = None

    def record(self, stream: FakeStream) -> None:
        mark = self.latest = {"done": False}
        stream.ops.append(Op(lambda: True, lambda: mark.update(done=True)))

    def query(self) -> bool:
        return self.latest is None or self.latest["done"]


def _fakes(gpu: FakeGPU) -> tuple[Any, Any]:
    def flag(addr: int) -> ctypes.c_uint32:
        return ctypes.c_uint32.from_address(addr)

    def alloc(nbytes: int, zero: bool = False) -> int:
        buf = ctypes.create_string_buffer(nbytes)
        gpu.memory.append(buf)
        return ctypes.addressof(buf)

    def enqueue(stream: int, op: Op) -> None:
        gpu.streams[stream].ops.append(op)

    drv = types.SimpleNamespace(
        DriverError=cudadrv.DriverError, alloc=alloc, free=lambda ptr: None, ipc_close=lambda ptr: None,
        ipc_handle=lambda ptr: ptr.to_bytes(64, "little"), ipc_open=lambda h: int.from_bytes(h, "little"),
        copy=lambda dst, src, n, st: enqueue(st, Op(lambda: True, lambda: ctypes.memmove(dst, src, n))),
        wait_at_least=lambda st, addr, v: enqueue(st, Op(lambda: ((flag(addr).value - v) & 0xFFFFFFFF) < 2**31)),
        write=lambda st, addr, v: enqueue(st, Op(lambda: True, lambda: setattr(flag(addr), "value", v))))
    cuda = types.SimpleNamespace(Stream=lambda device: FakeStream(gpu), Event=FakeEvent,
                                 current_stream=lambda: gpu.current, synchronize=gpu.run)
    return drv, cuda


class FakeMPI:
    def __init__(self, rank: int, boxes: dict[tuple[int, int, int], list[Any]]) -> None:
        self.rank, self.boxes = rank, boxes

    def send(self, obj: Any, dest: int, tag: int) -> None:
        self.boxes.setdefault((self.rank, dest, tag), []).append(obj)

    def Iprobe(self, source: int, tag: int) -> bool:
        return bool(self.boxes.get((source, self.rank, tag)))

    def recv(self, source: int, tag: int) -> Any:
        box = self.boxes.get((source, self.rank, tag))
        assert box, f"rank {self.rank} would wait for a message (tag {tag}) that rank {source} never sent"
        return box.pop(0)


KEY = (0, 1, "F")


@pytest.fixture(params=range(6))
def pair(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:
    """A sender (rank 0) and a receiver (rank 1) of channel KEY, each with its compute stream and flags page,
    on a fake GPU of one of several random orders."""
    gpu = FakeGPU(request.param)
    drv, cuda = _fakes(gpu)
    monkeypatch.setattr(celink, "cudadrv", drv)
    monkeypatch.setattr(celink, "cuda", cuda)
    boxes: dict[tuple[int, int, int], list[Any]] = {}
    pages = [drv.alloc(256), drv.alloc(256)]
    sides = []
    for rank in (0, 1):
        world = types.SimpleNamespace(rank=rank, mpi=FakeMPI(rank, boxes), device=torch.device("cpu"))
        compute = FakeStream(gpu)
        gpu.current = compute
        mine, theirs = (pages[0] + 4, pages[1]) if rank == 0 else (pages[1], pages[0] + 4)
        end = celink.End(KEY, world.device, mine, theirs)
        sides.append((celink.CopyEngines(world, {KEY: end}, []), compute))

    def on(rank: int) -> celink.CopyEngines:
        gpu.current = sides[rank][1]
        return sides[rank][0]

    return gpu, on


def _message(n: int, size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(size, generator=g), torch.randint(0, 1000, (3, size // 2 + 1), generator=g)]


def _empty_like(msg: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.full_like(t, -1) for t in msg]


def test_every_message_arrives_in_order_and_rings_grow(pair: Any) -> None:
    gpu, on = pair
    sizes = [64, 64, 64, 300, 300, 64, 1000, 8, 8, 8, 1000, 64]  # grows twice; smaller ones reuse the big ring
    msgs = [_message(n, s) for n, s in enumerate(sizes)]
    for msg in msgs:  # the sender runs far ahead of the receiver: its stream must wait for the pulls
        on(0).send(KEY, msg)
    assert not gpu.run(), "the sender filled more slots than the ring has without waiting for the receiver"
    got = []
    for msg in msgs:
        bufs = _empty_like(msg)
        work = on(1).recv(KEY, bufs)
        work.wait()
        got.append(bufs)
    assert gpu.run(), "the protocol deadlocked"
    for msg, bufs in zip(msgs, got, strict=True):
        for a, b in zip(msg, bufs, strict=True):
            assert torch.equal(a, b)
    assert len(on(0).ends[KEY].rings) == 3 and len(on(1).ends[KEY].rings) == 3


def test_the_sender_never_overwrites_a_slot_not_pulled(pair: Any) -> None:
    gpu, on = pair
    msgs = [_message(n, 100) for n in range(3 * celink.SLOTS)]
    for msg in msgs:
        on(0).send(KEY, msg)
    first = _empty_like(msgs[0])
    on(1).recv(KEY, first).wait()
    gpu.run()
    assert all(torch.equal(a, b) for a, b in zip(msgs[0], first, strict=True))
    # one pull done: the sender packed at most SLOTS + 1 messages, the rest wait on its stream
    assert on(0).ends[KEY].stream.ops, "the sender's stream ran past slots the receiver still holds"
    rest = [_empty_like(m) for m in msgs[1:]]
    for bufs in rest:
        on(1).recv(KEY, bufs)
    assert gpu.run()
    for msg, bufs in zip(msgs[1:], rest, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(msg, bufs, strict=True))


def test_a_receive_posted_before_its_ring_is_known_is_pulled_at_its_use(pair: Any) -> None:
    gpu, on = pair
    msgs = [_message(n, 200) for n in range(3)]
    bufs = [_empty_like(m) for m in msgs]
    works = [on(1).recv(KEY, b) for b in bufs]  # no ring message yet: deferred, nothing waits on the host
    assert all(w.event is None for w in works)
    for msg in msgs:
        on(0).send(KEY, msg)
    works[1].wait()  # its use: reads the ring, posts receives 0 and 1 in order
    assert works[0].event is not None and works[2].event is None
    works[2].wait()
    assert gpu.run()
    for msg, b in zip(msgs, bufs, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(msg, b, strict=True))


def test_the_counters_wrap(pair: Any) -> None:
    gpu, on = pair
    for side in (0, 1):
        on(side).ends[KEY].count = 2**32 - 2  # both ends count alike; the flags hold the same wrapped values
    for addr in (on(0).ends[KEY].mine, on(1).ends[KEY].mine):
        ctypes.c_uint32.from_address(addr).value = 2**32 - 2
    msgs = [_message(n, 50) for n in range(2 * celink.SLOTS)]
    got = [_empty_like(m) for m in msgs]
    for msg, bufs in zip(msgs, got, strict=True):
        on(0).send(KEY, msg)
        on(1).recv(KEY, bufs)
    assert gpu.run()
    for msg, bufs in zip(msgs, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(msg, bufs, strict=True))


def test_p2p_transport_is_checked_with_one_line() -> None:
    assert cesetup.p2p_transport({}) == "auto"
    with pytest.raises(config.ConfigError, match=r"^PIPEFLOW_P2P must be one of auto, nccl, ce, found 'nvlink'$"):
        config.check_environment({"PIPEFLOW_P2P": "nvlink"})


def test_copy_engines_asked_for_on_cpu_is_refused_with_one_line() -> None:
    with pytest.raises(config.ConfigError, match=r"^PIPEFLOW_P2P=ce moves tensors on the GPUs' copy engines, but the "
                       r"ranks run on the CPU \(--device cpu\); use PIPEFLOW_P2P=auto or nccl$"):
        config.check_transport("cpu", {"PIPEFLOW_P2P": "ce"})
    config.check_transport("cpu", {"PIPEFLOW_P2P": "auto"})  # auto falls back to NCCL / gloo


@in_background
def test_pipeflow_train_refuses_copy_engines_on_cpu_before_any_work() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pipeflow.train", "--model", "mlp", "--steps", "1", "--device", "cpu"],
                          env={**base_env(), "PIPEFLOW_P2P": "ce"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pipeflow-train: error: PIPEFLOW_P2P=ce moves tensors on the GPUs' copy engines, but the ranks run on the "
        "CPU (--device cpu); use PIPEFLOW_P2P=auto or nccl"]


def test_copy_engines_only_between_peer_gpus_of_one_host() -> None:
    keys = [(0, 1, "F"), (1, 0, "B"), (1, 2, "F"), (2, 1, "B"), (2, 3, "F"), (3, 2, "B")]
    ranks = [("a", 0, [0, 1]), ("a", 1, [0, 1]),  # peers
             ("b", 0, [0]), ("b", 1, [1])]        # one host, but no peer access (e.g. PCIe across sockets)
    # 1 -> 2 crosses hosts; 2 <-> 3 cannot access each other: NCCL for those
    assert cesetup.usable_channels(keys, ranks) == [(0, 1, "F"), (1, 0, "B")]
    ranks[3] = ("b", 1, [0, 1])  # access one way only is not enough
    assert cesetup.usable_channels(keys, ranks) == [(0, 1, "F"), (1, 0, "B")]
    ranks[2] = ("b", 0, [0, 1])
    assert cesetup.usable_channels(keys, ranks) == [(0, 1, "F"), (1, 0, "B"), (2, 3, "F"), (3, 2, "B")]
    with pytest.raises(UsageError, match=r"^PIPEFLOW_P2P=ce: ranks 1 and 2 cannot use the copy engines \(CUDA GPUs of "
                       r"one host with peer access are needed\); use PIPEFLOW_P2P=auto or nccl$"):
        cesetup.usable_channels(keys, ranks, "ce")


def test_a_receive_that_never_arrives_is_reported_after_the_timeout(pair: Any, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    gpu, on = pair
    clock = [100.0]
    # celink's own clock only: patching the time module's would stop every other thread's clock too (the
    # background tests', conftest.in_background)
    monkeypatch.setattr(celink, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    on(0).send(KEY, _message(0, 10))  # the ring is known: the second receive is posted on the GPU
    first = _empty_like(_message(0, 10))
    on(1).recv(KEY, first).wait()
    assert gpu.run()
    bufs = _empty_like(_message(1, 10))
    on(1).recv(KEY, bufs)  # rank 0 never sends it
    gpu.run()
    receiver = on(1)
    assert receiver.stalled(30.0) is None
    clock[0] += 31.0
    assert receiver.stalled(30.0) == (0, "a tensor it sends on the copy engines has not arrived after 31.0 s "
                                         "(--timeout 30)")
    on(0).send(KEY, _message(1, 10))
    assert gpu.run()
    assert receiver.stalled(30.0) is None


def test_the_watchdog_ends_the_job_on_a_stalled_transfer() -> None:
    from pipeflow.watchdog import Watchdog

    dog = Watchdog.__new__(Watchdog)  # only what watch and the check read: no MPI
    failed: list[tuple[int, str]] = []
    dog.checks = []
    dog._fail = lambda peer, why: failed.append((peer, why))  # type: ignore[method-assign]
    dog.watch(lambda: None)
    dog._check_transfers()
    assert failed == []
    dog.watch(lambda: (3, "a tensor it sends on the copy engines has not arrived"))
    dog._check_transfers()
    assert failed == [(3, "a tensor it sends on the copy engines has not arrived")]


def test_a_check_that_fails_is_dropped_and_the_heartbeats_go_on(caplog: pytest.LogCaptureFixture) -> None:
    from pipeflow.watchdog import Watchdog

    dog = Watchdog.__new__(Watchdog)
    dog.checks = []

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    dog.watch(broken)
    dog._check_transfers()  # no exception out of the watchdog's loop
    assert dog.checks == []
    assert "a transfer check failed and is no longer run: CUDA error: an illegal memory access" in caplog.text


def test_p2p_hands_the_copy_engine_channels_to_celink_and_the_rest_to_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """comm.P2P: a channel celink set up is neither warmed up nor used through NCCL; the others are, as before."""
    from types import SimpleNamespace

    import pipeflow.comm as comm

    nccl: list[tuple[Any, tuple[tuple[int, ...], ...]]] = []
    done = SimpleNamespace(wait=lambda: None, is_completed=lambda: True)

    def batch(ops: list[Any]) -> list[Any]:
        nccl.append((ops[0].op, tuple(tuple(op.tensor.shape) for op in ops)))
        return [done]

    class FakeEngines:
        def __init__(self) -> None:
            self.sent: list[tuple[Key, int]] = []
            self.ring_bytes, self.closed = 4096, False

        def has(self, key: Key) -> bool:
            return key == (0, 1, "F")

        def send(self, key: Key, bufs: list[torch.Tensor]) -> Any:
            self.sent.append((key, len(bufs)))
            return done

        def close(self) -> None:
            self.closed = True

    Key = tuple[int, int, str]
    engines = FakeEngines()
    asked: list[tuple[list[Key], str]] = []
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(comm.dist, "P2POp", lambda op, tensor, peer, group: SimpleNamespace(op=op, tensor=tensor))
    monkeypatch.setattr(comm, "setup_copy_engines", lambda world, keys, mode: asked.append((keys, mode)) or engines)
    monkeypatch.setenv("PIPEFLOW_P2P", "auto")
    world = SimpleNamespace(rank=0, size=2, device=torch.device("cpu"), mpi=None)
    p2p = comm.P2P(world, {(0, 1, "F"): "gF", (1, 0, "B"): "gB"})  # type: ignore[arg-type]
    p2p.warm_up()
    assert asked == [([(0, 1, "F"), (1, 0, "B")], "auto")]
    assert nccl == [(comm.dist.irecv, ((1,),))]  # only the gradient channel is opened through NCCL
    p2p.send([torch.ones(2), torch.ones(3, 1)], 1, "F")
    assert engines.sent == [((0, 1, "F"), 2)] and len(nccl) == 1
    p2p.recv(1, "B", meta=[((2,), torch.float32, False)])
    assert nccl[-1] == (comm.dist.irecv, ((2,),))
    assert p2p.ring_bytes() == 4096
    p2p.close()
    assert engines.closed and p2p.ce is None and p2p.ring_bytes() == 0


class ScriptedMPI:
    """Rank 0's view of a 2-rank job: each allgather returns this rank's value and rank 1's scripted one."""

    def __init__(self, theirs: list[Any]) -> None:
        self.theirs = theirs

    def allgather(self, mine: Any) -> list[Any]:
        return [mine, self.theirs.pop(0)]


def _setup(monkeypatch: pytest.MonkeyPatch, theirs_error: str | None, mode: str = "auto",
           open_fails: bool = False) -> Any:
    gpu = FakeGPU(0)
    drv, cuda = _fakes(gpu)
    peer_page = drv.alloc(256)
    if open_fails:
        def refuse(handle: bytes) -> int:
            raise cudadrv.DriverError("cuIpcOpenMemHandle_v2 failed: CUDA error 201 (invalid device context)")
        drv.ipc_open = refuse
    monkeypatch.setattr(celink, "cudadrv", drv)
    monkeypatch.setattr(celink, "cuda", cuda)
    monkeypatch.setattr(cesetup.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cesetup.torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr(cesetup.socket, "gethostname", lambda: "host")
    mpi = ScriptedMPI([("host", 1, [0, 1]), peer_page.to_bytes(64, "little"), theirs_error])
    world = types.SimpleNamespace(rank=0, local_rank=0, device=torch.device("cuda", 0), mpi=mpi)
    return cesetup.setup(world, [(0, 1, "F"), (1, 0, "B")], mode), peer_page


def test_setup_maps_the_peers_flags_and_probes_the_stream_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    ce, peer_page = _setup(monkeypatch, None)
    send, recv = ce.ends[(0, 1, "F")], ce.ends[(1, 0, "B")]
    own = ce.pages[0]
    assert (send.mine, send.theirs) == (own + 4, peer_page)      # my `empty`, the receiver's `full` (channel 0)
    assert (recv.mine, recv.theirs) == (own + 8, peer_page + 12)  # my `full`, the sender's `empty` (channel 1)
    assert ctypes.c_uint32.from_address(own + 16).value == 1  # the probe's flag, written and waited for


def test_setup_falls_back_to_nccl_on_every_rank_when_one_cannot(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    why = "cuStreamWaitValue32_v2 failed: CUDA error 801 (operation not supported)"
    assert _setup(monkeypatch, why)[0] is None
    assert f"the copy engines cannot be set up (rank 1: {why}): point-to-point goes through NCCL" in caplog.text
    with pytest.raises(UsageError, match=r"^PIPEFLOW_P2P=ce: the copy engines cannot be set up \(rank 0: "
                       r"cuIpcOpenMemHandle_v2 failed: CUDA error 201 \(invalid device context\)\); use "
                       r"PIPEFLOW_P2P=auto or nccl$"):
        _setup(monkeypatch, None, mode="ce", open_fails=True)


def _pair_sum(monkeypatch: pytest.MonkeyPatch, seed: int) -> tuple[Any, list[tuple[celink.PairSum, Any]]]:
    """Two replicas' celink.PairSum ends on a fake GPU (and their compute streams)."""
    gpu = FakeGPU(seed)
    drv, cuda = _fakes(gpu)
    monkeypatch.setattr(celink, "cudadrv", drv)
    monkeypatch.setattr(celink, "cuda", cuda)
    monkeypatch.setattr(celink, "add_on", lambda st, t, buf: st.ops.append(Op(lambda: True, lambda: t.add_(buf))))
    boxes: dict[tuple[int, int, int], list[Any]] = {}
    pages = [drv.alloc(256), drv.alloc(256)]
    out, into = (0, 1, "R"), (1, 0, "R")  # flags as cesetup lays them: key i's `full` at 8i, `empty` at 8i + 4
    sides = []
    for rank in (0, 1):
        world = types.SimpleNamespace(rank=rank, mpi=FakeMPI(rank, boxes), device=torch.device("cpu"))
        compute = FakeStream(gpu)
        me, peer = pages[rank], pages[1 - rank]
        ends = {out: celink.End(out, world.device, me + 4, peer) if rank == 0 else celink.End(out, world.device, me,
                                                                                              peer + 4),
                into: celink.End(into, world.device, me + 8, peer + 12) if rank == 0 else celink.End(
                    into, world.device, me + 12, peer + 8)}
        sides.append((celink.PairSum(celink.CopyEngines(world, ends, []), rank, 1 - rank), compute))
    return gpu, sides


@pytest.mark.parametrize("seed", range(6))
def test_two_replicas_sum_on_the_copy_engines(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """celink.PairSum (PIPEFLOW_REDUCE=ce): each replica sends its tensor and adds the one it pulls; both end with
    a + b exactly (the sum NCCL's two-rank all-reduce gives), in any order of the streams, with rings growing, every
    pull posted at its receive (reading a new ring's message then), and a replica's tensor copied out before the
    peer's is added to it."""
    gpu, sides = _pair_sum(monkeypatch, seed)
    sizes = [64, 300, 300, 8, 1000, 64, 64, 64, 64, 300]  # more messages than slots; the ring grows twice
    g = torch.Generator().manual_seed(seed)
    tensors = [[torch.randn(n, generator=g) for n in sizes] for _ in range(2)]
    want = [a + b for a, b in zip(*tensors, strict=True)]
    works: list[list[Any]] = [[], []]
    for i in range(len(sizes)):  # both send, then both receive: a receive reads the peer's ring message at once
        sent = []
        for rank in (0, 1):
            gpu.current = sides[rank][1]
            sent.append(sides[rank][0].send(tensors[rank][i]))
        for rank in (0, 1):
            gpu.current = sides[rank][1]
            works[rank].append(sides[rank][0].receive(tensors[rank][i], sent[rank]))
    # Every pull posted at its receive, none left to a wait: the peer's sends past SLOTS wait on the GPU for them.
    assert all(w.got.event is not None and w.event is not None for ws in works for w in ws)
    for rank in (0, 1):
        gpu.current = sides[rank][1]
        for w in works[rank]:
            w.wait()
    assert gpu.run(), "the exchange deadlocked"
    for rank in (0, 1):
        for got, exp in zip(tensors[rank], want, strict=True):
            assert torch.equal(got, exp)


def test_a_pair_sums_receive_waits_for_the_peers_ring_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receive whose ring message has not come is posted at once, the host waiting for that message (which the
    peer sends at its own send of this message), not left to its wait: the peer's sends past SLOTS wait on the GPU
    for its pulls, and a device-wide sync before that wait (NCCL creating the presence flags' communicator) hung
    both ranks on 2 x H200. Here rank 0 receives before rank 1 has sent: the fake MPI says it would wait."""
    gpu, sides = _pair_sum(monkeypatch, 0)
    gpu.current = sides[0][1]
    t = torch.ones(8)
    sent = sides[0][0].send(t)
    with pytest.raises(AssertionError, match="rank 0 would wait for a message"):
        sides[0][0].receive(t, sent)
