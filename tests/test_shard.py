"""--shard-optimizer (pipeflow/shard.py): a replicated stage's optimizer state split over its replicas gives the same
weights, bit for bit, under every schedule kind, and checkpoints hold the whole state."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeflow.shard import ShardedUpdate, owners, sharded
from tests.conftest import Case, MpiRun, batched

GPT = {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256}
MLP = {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256}
WIDE = {"layers": 3, "hidden": 1024, "d_in": 8, "samples": 64}  # 1024 x 1024 weights: broadcast in place (LARGE)
MODELS = {"gpt": ("gpt", GPT), "mlp": ("mlp", MLP), "mlp-wide": ("mlp", WIDE),
          "gpt-tied": ("gpt", {**GPT, "tie": True})}  # the head's weight is the embedding's, on two stages


def test_owners_balance_the_bytes_and_agree_on_every_replica() -> None:
    assert owners([100, 50, 40, 30], 2) == [0, 1, 1, 1]
    assert owners([8, 8, 8], 3) == [0, 1, 2] and owners([], 2) == []
    rng = random.Random(3)
    for _ in range(200):
        sizes = [rng.randint(1, 1000) for _ in range(rng.randint(1, 40))]
        r = rng.randint(1, 5)
        got = owners(sizes, r)
        assert got == owners(list(sizes), r)  # a pure function of the sizes: every replica computes the same
        load = [sum(s for s, q in zip(sizes, got) if q == k) for k in range(r)]
        assert max(load) - min(load) <= max(sizes)  # largest first to the least loaded: within one tensor


def test_a_stage_with_fewer_tensors_than_replicas_is_not_sharded(caplog: pytest.LogCaptureFixture) -> None:
    one = [nn.Parameter(torch.zeros(4))]
    assert sharded(one, 1, 0, None, [0]) is None
    with caplog.at_level("WARNING"):
        assert sharded(one, 2, 1, None, [0, 1]) is None
    assert "the stage has 1 parameter tensors for 2 replicas; its optimizer state is not sharded" in caplog.text
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    shard = ShardedUpdate([*one, frozen, nn.Parameter(torch.zeros(2))], 2, 1)
    assert shard.complete and [p.numel() for p in shard.owned] == [2]  # the frozen one is nobody's


class _Delivery:
    """A transfer's work: wait() writes what the owner sent into the receiving tensors and is logged."""

    def __init__(self, log: list[tuple[str, int]], chunk: int, recvs: list[tuple[torch.Tensor, int]]) -> None:
        self.log, self.chunk, self.recvs = log, chunk, recvs

    def wait(self) -> None:
        self.log.append(("wait", self.chunk))
        for t, _ in self.recvs:
            t.fill_(7.0)


def test_the_owners_weights_land_layer_by_layer_under_the_next_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Armed (flush schedules, 2bw's deferred updates): the exchange is one batch per chunk in the layers' order, all
    in flight when the STEP returns; each layer's forward first lands the chunks up to its own (received buckets
    unpacked there), so it computes on the new weights, and so do pre-hooks registered before (torch.nn.utils.
    weight_norm computes a layer's weight in one); `finish` lands the rest (Update.settle)."""
    import pipeflow.shard as shard_module

    log: list[tuple[str, int]] = []
    calls: list[int] = []

    def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: object
                 ) -> list[_Delivery]:
        calls.append(len(calls))
        return [_Delivery(log, len(calls) - 1, recvs)]

    monkeypatch.setattr(shard_module, "exchange", exchange)
    monkeypatch.setattr(shard_module, "CHUNK_BYTES", 1)  # a chunk per layer
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 4))
    for k, layer in enumerate(layers):  # registered before the shard's, as weight_norm's would be: runs after it
        layer.register_forward_pre_hook(lambda _m, _a, k=k: log.append(("forward", k)))
    shard = ShardedUpdate(list(layers.parameters()), 2, 0)
    shard.connect(None, [0, 1])
    shard.arm(list(layers))
    shard.broadcast()
    assert calls == [0, 1, 2] and log == []  # three layers with weights, nothing waited for yet
    layers(torch.ones(2, 4))
    assert log == [("wait", 0), ("forward", 0), ("forward", 1), ("wait", 1), ("forward", 2), ("wait", 2),
                   ("forward", 3)]
    theirs = [p for p, q in zip(shard.params, shard.owner) if q == 1]
    assert theirs and all(bool((p == 7.0).all()) for p in theirs)  # the other owner's weights, unpacked
    log.clear()
    shard.broadcast()
    shard.finish()  # a reader other than a forward (Update.settle: checkpoints, --save)
    assert log == [("wait", 3), ("wait", 4), ("wait", 5)]
    unarmed = ShardedUpdate(list(layers.parameters()), 2, 0)
    unarmed.connect(None, [0, 1])
    log.clear()
    unarmed.broadcast()  # async: one batch, landed before the STEP returns
    assert log == [("wait", 6)]


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_arming_leaves_scripted_layers_and_the_layers_after_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TorchScript layer takes no forward pre-hook: the stage is not armed (its exchange lands in the STEP, as
    before) instead of failing at set-up. `close` (the end of training) lands what is in flight and removes the
    hooks from the user's layers: a module that trained sharded pickles again and holds no reference to the shard."""
    import io

    import pipeflow.shard as shard_module

    log: list[tuple[str, int]] = []
    monkeypatch.setattr(shard_module, "exchange", lambda sends, recvs, group: [_Delivery(log, len(log), recvs)])
    scripted = [torch.jit.script(nn.Linear(4, 4)), nn.Linear(4, 4)]
    shard = ShardedUpdate([p for m in scripted for p in m.parameters()], 2, 0)
    shard.connect(None, [0, 1])
    shard.arm(scripted)
    assert not shard.armed
    shard.broadcast()
    assert log == [("wait", 0)] and not shard.inflight  # landed before the STEP returns
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    shard = ShardedUpdate([p for m in layers for p in m.parameters()], 2, 0)
    shard.connect(None, [0, 1])
    shard.arm(layers)
    shard.broadcast()
    assert shard.inflight
    shard.close()
    assert not shard.inflight and not shard.armed and all(not m._forward_pre_hooks for m in layers)
    torch.save(layers[0], io.BytesIO())


def test_a_drain_lands_the_exchange_before_the_owners_weights_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """2bw's deferred update (armed): a segment's end applies the held gradient (Update.drain) with no forward since
    the last STEP, whose exchange still sends the owners' tensors in place; its optimizer step waits for it."""
    import pipeflow.shard as shard_module
    from pipeflow.update import Update

    log: list[tuple[str, int]] = []
    monkeypatch.setattr(shard_module, "exchange", lambda sends, recvs, group: [_Delivery(log, len(log), recvs)])
    layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    params = list(layers.parameters())
    shard = ShardedUpdate(params, 2, 0)
    shard.connect(None, [0, 1])
    shard.arm(list(layers))
    opt = torch.optim.SGD(shard.owned, lr=0.1)
    step = opt.step
    in_flight: list[int] = []

    def counted(*args: object, **kwargs: object) -> object:
        in_flight.append(len(shard.inflight) - shard.landed)
        return step(*args, **kwargs)

    monkeypatch.setattr(opt, "step", counted)
    update = Update(opt, params, shard, [], deferred=True, late=False, broadcast_overlaps=False)
    for _ in range(2):  # two minibatches of a segment; no forward after the second STEP
        for p in params:
            p.grad = torch.ones_like(p)
        update.reduce()
        update.step(None, [])
    update.drain(None)
    assert in_flight == [0, 0]  # the second STEP's update and the drain's: nothing in flight under either


def _plan(d: Path, schedule: str, stages: list[tuple[tuple[int, int], list[int]]]) -> Path:
    plan = {"format": "pipeflow.plan/1", "schedule": schedule, "microbatches": 4,
            "workers": len({q for _, r in stages for q in r}),
            "stages": [{"layers": list(ls), "replicas": len(r), "ranks": r} for ls, r in stages]}
    path = d / f"plan-{schedule}.json"
    path.write_text(json.dumps(plan))
    return path


def _runs(d: Path, model: str, schedule: str, stages: list[tuple[tuple[int, int], list[int]]],
          extra: list[str]) -> list[Case]:
    args = ["--model", MODELS[model][0], "--model-args", json.dumps(MODELS[model][1]),
            "--plan", str(_plan(d, schedule, stages)), "--steps", "4", "--microbatch-size", "2",
            "--optimizer", "adam", "--lr", "0.01", "--dtype", "float64", "--device", "cpu", *extra]
    np_ = len({q for _, r in stages for q in r})
    return [Case(np_, [*args, "--save", str(d / "plain.pt")]),
            Case(np_, [*args, "--shard-optimizer", "--save", str(d / "sharded.pt")], env={"PIPEFLOW_LOG": "INFO"})]


KINDS = {  # a pipeline of two replicated stages, and data parallelism under the asynchronous kinds
    "1f1b-2x2": ("gpt", "1f1b", [((0, 2), [0, 1]), ((2, 4), [2, 3])]),
    "2bw-dp": ("mlp", "2bw", [((0, 6), [0, 1])]),
    "async-dp": ("mlp", "async", [((0, 6), [0, 1])]),
    "interleaved": ("mlp", "interleaved", [((0, 2), [0, 1]), ((2, 4), [2, 3]), ((4, 5), [0, 1]), ((5, 6), [2, 3])]),
    "1f1b-tied": ("gpt-tied", "1f1b", [((0, 2), [0, 1]), ((2, 4), [2, 3])]),  # one Parameter, two owners' groups
    "1f1b-wide": ("mlp-wide", "1f1b", [((0, 3), [0, 1])]),  # large tensors in place, small ones in buckets
    "2bw-wide": ("mlp-wide", "2bw", [((0, 3), [0, 1])]),  # the same, its update deferred a STEP (update.py)
    # stage 0's broadcast deferred under the next minibatch (it runs ahead), stage 1's update deferred a STEP
    "2bw-wide-2x2": ("mlp-wide", "2bw", [((0, 2), [0, 1]), ((2, 3), [2, 3])]),
    "async-2x2": ("mlp", "async", [((0, 3), [0, 1]), ((3, 6), [2, 3])]),  # stage 0 copies live weights ahead
    "zb-h2-2x2": ("mlp", "zb-h2", [((0, 3), [0, 1]), ((3, 6), [2, 3])]),  # the reducer armed at W, not B
}


def same_weights(d: Path, kind: str) -> list[Case]:
    model, schedule, stages = KINDS[kind]
    return _runs(d, model, schedule, stages, [])


@pytest.mark.parametrize("kind", list(KINDS))
@batched(same_weights)
def test_sharded_update_gives_the_same_weights_bit_for_bit(mpi: MpiRun, kind: str) -> None:
    plain = torch.load(mpi.dir / "plain.pt", weights_only=True)
    got = torch.load(mpi.dir / "sharded.pt", weights_only=True)
    assert list(got) == list(plain)
    for k in plain:
        assert torch.equal(got[k], plain[k]), (kind, k)
    shares = re.findall(r"\[rank (\d)\] INFO pipeflow.shard: optimizer sharded over 2 replicas: this rank updates "
                        r"(\d+) of the stage's (\d+) parameter bytes", mpi.proc.stderr)
    ranks = len({q for _, r in KINDS[kind][2] for q in r})
    assert sorted(int(r) for r, _, _ in shares) == list(range(ranks))  # every rank holds a share, none the whole
    assert all(0 < int(mine) < int(total) for _, mine, total in shares)
    # the next forward reads the live weights under the flush schedules and where 2bw defers its update (its last
    # stage): the exchange lands there layer by layer; async's next forward follows its STEP at once
    armed = set(re.findall(r"\[rank (\d)\] INFO pipeflow.shard: the owners' weights land layer by layer",
                           mpi.proc.stderr))
    expected = {"async-dp": set(), "async-2x2": set(), "2bw-wide-2x2": {"2", "3"}}.get(kind, {str(r) for r in
                                                                                          range(ranks)})
    assert armed == expected


def checkpoints(d: Path) -> list[Case]:
    """Checkpointed every 2 steps with and without sharding, then a sharded run resumed from step 2."""
    stages = [((0, 3), [0, 1]), ((3, 6), [2, 3])]
    runs = _runs(d, "mlp", "1f1b", stages, [])
    ck = ["--checkpoint-every", "2"]
    plain = Case(4, [*runs[0].args[:-2], *ck, "--checkpoint-dir", str(d / "ck-plain")])
    shard = Case(4, [*runs[1].args[:-2], *ck, "--checkpoint-dir", str(d / "ck-shard")])
    resumed = Case(4, [*runs[1].args[:-2], "--resume", str(d / "ck-shard" / "step-000002"),
                       "--save", str(d / "resumed.pt")])
    return [*runs, plain, shard, resumed]


@batched(checkpoints)
def test_a_sharded_checkpoint_holds_every_state_and_resumes_exactly(mpi: MpiRun) -> None:
    for stage in ("stage-000.pt", "stage-001.pt"):
        a = torch.load(mpi.dir / "ck-plain" / "step-000002" / stage, weights_only=True)["optimizer"]
        b = torch.load(mpi.dir / "ck-shard" / "step-000002" / stage, weights_only=True)["optimizer"]
        assert list(b["state"]) == list(a["state"]) and b["groups"] == a["groups"]
        for name, st in a["state"].items():
            assert st.keys() == b["state"][name].keys()
            for key, v in st.items():
                w = b["state"][name][key]
                assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (stage, name, key)
    whole = torch.load(mpi.dir / "sharded.pt", weights_only=True)
    got = torch.load(mpi.dir / "resumed.pt", weights_only=True)
    for k in whole:
        assert torch.equal(got[k], whole[k]), k


def test_the_planner_prices_a_sharded_update_and_its_memory(tmp_path: Path) -> None:
    """pipeflow-plan --shard-optimizer: a replica holds 1/r of the optimizer state (here what lets data
    parallelism fit under the limit) and runs 1/r of the update, then receives (r - 1)/r of the weights."""
    from dataclasses import replace

    from partitioner.cli import main
    from partitioner.plan import Plan
    from partitioner.price import price
    from partitioner.profile import LayerProfile, Profile
    from partitioner.service import layer_costs
    from partitioner.topology import Topology

    gb = 1e9
    prof = Profile("m", {}, "cpu", "float32", 1, [LayerProfile(f"l{i}", 10.0, 20.0, 1e6, 1e6, gb) for i in range(2)],
                   optimizer_ms_per_byte={"adam": 1e-8})
    prof.save(tmp_path / "p.json")
    args = [str(tmp_path / "p.json"), "--workers", "2", "--topology", "2x1000GB/s", "--microbatches", "4",
            "--memory-per-worker", "7GB", "-o"]
    assert main([*args, str(tmp_path / "plain.json")]) == 0
    assert main([*args, str(tmp_path / "sharded.json"), "--shard-optimizer"]) == 0
    plain, sharded_plan = Plan.load(tmp_path / "plain.json"), Plan.load(tmp_path / "sharded.json")
    assert plain.replicas == [1, 1] and not plain.shard_optimizer  # data parallel needs 2 GB x (2 + 2) = 8 GB
    assert sharded_plan.replicas == [2] and sharded_plan.shard_optimizer  # 2 GB x (2 + 1) fits
    assert 6 * gb < max(sharded_plan.predicted["peak_memory_bytes"]) <= 7 * gb
    assert sharded_plan.predicted["step_ms"] < plain.predicted["step_ms"]
    lay = layer_costs(prof, "1f1b", "adam")
    topo = Topology.parse("2x1000GB/s")
    whole = price(lay, topo, "1f1b", 4, [(0, 2)], [[0, 1]], optimizer="adam")[0][0]
    half = price(replace(lay, shard_optimizer=True), topo, "1f1b", 4, [(0, 2)], [[0, 1]], optimizer="adam")[0][0]
    assert whole.optimizer_ms == pytest.approx(1e-8 * 2 * gb)  # 20 ms: the whole update on every replica
    # 10 ms, then the owners' exchange priced as an all-reduce of the 2 GB: 2 ms at 1000 GB/s (before: 1 ms, the
    # bytes it moves; NCCL's point-to-point reached half the all-reduce's bandwidth on 2 x H200, benchmarks/gpu).
    # It lands layer by layer under the next forward (20 ms for the two layers): the first layer's half waits.
    assert half.optimizer_ms == pytest.approx(1e-8 * gb + 2 * gb / 1e9 / 2)
    assert half.state_share == 0.5 and whole.state_share == 1.0
    # 200 ms of exchange: the second layer's forward (10 ms) waits for all of it, the stage 190 ms beyond its 20
    slow = Topology.parse("2x10GB/s")
    assert price(replace(lay, shard_optimizer=True), slow, "1f1b", 4, [(0, 2)], [[0, 1]],
                 optimizer="adam")[0][0].optimizer_ms == pytest.approx(1e-8 * gb + 200 + 10 - 20)
    # async's next forward follows the update at once: the whole exchange in the STEP
    asynchronous = price(replace(layer_costs(prof, "async", "adam"), shard_optimizer=True), topo, "async", 4,
                         [(0, 2)], [[0, 1]], optimizer="adam")[0][0]
    assert asynchronous.optimizer_ms == pytest.approx(1e-8 * gb + 2 * gb / 1e9)
    # 2bw: where forwards run ahead of the minibatch's end (stage 0 of two), the broadcast travels under the next
    # minibatch (ScheduleKind.broadcast_overlaps), off the STEP; data parallel 2bw defers its update instead
    # (pipeflow/update.py) and runs the next minibatch on the live weights: the exchange lands under its forward.
    shard = replace(lay, shard_optimizer=True)
    dp = price(shard, topo, "2bw", 4, [(0, 2)], [[0, 1]], optimizer="adam")[0][0]
    assert dp.optimizer_ms == pytest.approx(half.optimizer_ms)
    piped = price(shard, Topology.parse("3x1000GB/s"), "2bw", 4, [(0, 1), (1, 2)], [[0, 1], [2]], optimizer="adam")[0]
    assert piped[0].optimizer_ms == pytest.approx(1e-8 * gb / 2)  # half of stage 0's 1 GB, no broadcast


def plan_says_so(d: Path) -> Case:
    path = _plan(d, "1f1b", [((0, 6), [0, 1])])
    plan = json.loads(path.read_text())
    path.write_text(json.dumps({**plan, "shard_optimizer": True}))
    return Case(2, ["--model", "mlp", "--model-args", json.dumps(MLP), "--plan", str(path), "--steps", "2",
                    "--microbatch-size", "2", "--device", "cpu"], env={"PIPEFLOW_LOG": "INFO"})


@batched(plan_says_so)
def test_pipeflow_train_shards_where_the_plan_says_so(mpi: MpiRun) -> None:
    assert mpi.proc.stderr.count("INFO pipeflow.shard: optimizer sharded over 2 replicas") == 2
