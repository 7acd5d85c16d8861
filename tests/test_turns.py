"""Two gloo process groups per point-to-point channel, taken in turn (pipeflow/links.py gloo_turns, pipeflow/turns.py):
who decides, that both ends of a channel agree message by message, and equality with one process under mpirun."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeflow import config
from pipeflow.comm import P2P
from pipeflow.links import gloo_turns
from pipeflow.turns import Turns
from tests.conftest import Case, MpiRun, batched
from tests.reference import reference_flush


@dataclass
class FakeMpi:
    gathered: list[Any]

    def allgather(self, _mine: Any) -> list[Any]:
        return self.gathered


@dataclass
class FakeWorld:
    gathered: list[Any]
    backend: str = "gloo"
    rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def size(self) -> int:
        return len(self.gathered)

    @property
    def mpi(self) -> FakeMpi:
        return FakeMpi(self.gathered)


@pytest.mark.parametrize("gathered,backend,turns", [
    ([("a", 2, "auto")] * 2, "gloo", 2),                         # a core per rank
    ([("a", 2, "auto")] * 4, "gloo", 1),                         # 4 ranks on 2 cores: gloo threads would cost more
    ([("a", 1, "auto"), ("b", 8, "auto"), ("b", 8, "auto")], "gloo", 2),  # every host has a core per rank
    ([("a", 1, "auto"), ("a", 1, "auto"), ("b", 8, "auto")], "gloo", 1),  # host a does not
    ([("a", 2, "1")] * 2, "gloo", 1),                            # PIPEFLOW_GLOO_GROUPS as rank 0 reads it
    ([("a", 2, "2"), ("a", 2, "auto"), ("a", 2, "1"), ("a", 2, "auto")], "gloo", 2),
    ([("a", 2, "auto")] * 2, "nccl", 1),                         # NCCL: one communicator per channel
])
def test_gloo_turns_is_decided_once_for_every_rank(gathered, backend, turns) -> None:
    assert gloo_turns(FakeWorld(gathered, backend=backend)) == turns  # type: ignore[arg-type]


def test_both_ends_of_a_channel_take_the_same_group_for_each_message() -> None:
    g0, g1 = object(), object()
    sender = P2P(FakeWorld([None, None], rank=0), {(0, 1, "F"): Turns([g0, g1])})  # type: ignore[arg-type]
    receiver = P2P(FakeWorld([None, None], rank=1), {(0, 1, "F"): Turns([g0, g1])})  # type: ignore[arg-type]
    sent = [sender._group(0, 1, "F") for _ in range(5)]
    got = [receiver._group(0, 1, "F") for _ in range(5)]
    assert sent == got == [g0, g1, g0, g1, g0]
    plain = P2P(FakeWorld([None, None]), {(0, 1, "F"): g0})  # type: ignore[arg-type]
    assert plain._group(0, 1, "F") is g0 and plain._group(0, 1, "F") is g0


def test_the_knob_is_checked_with_one_line() -> None:
    with pytest.raises(config.ConfigError, match=r"^PIPEFLOW_GLOO_GROUPS must be one of auto, 1, 2, found '4'$"):
        config.check_environment({"PIPEFLOW_GLOO_GROUPS": "4"})


MODELS = {"mlp": {"layers": 6, "hidden": 16, "d_in": 8, "samples": 256},
          "gpt": {"layers": 4, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256}}


def two_groups(d: Path, model: str, schedule: str, np_: int) -> Case:
    """Forced to two groups per channel, whatever the machine's cores."""
    v = ["--virtual-stages", "2"] if schedule == "interleaved" else []
    return Case(np_, ["--model", model, "--model-args", json.dumps(MODELS[model]), "--schedule", schedule, *v,
                      "--layers-per-stage", "even", "--steps", "3", "--microbatches", "4", "--microbatch-size", "2",
                      "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--dtype", "float64",
                      "--device", "cpu", "--save", str(d / "model.pt")],
                env={"PIPEFLOW_GLOO_GROUPS": "2", "PIPEFLOW_LOG": "INFO"})


@pytest.mark.parametrize("model,schedule,np_", [("gpt", "1f1b", 4), ("gpt", "interleaved", 2), ("mlp", "gpipe", 3)])
@batched(two_groups)
def test_two_groups_per_channel_equal_single_process(mpi: MpiRun, model, schedule, np_) -> None:
    assert mpi.proc.stderr.count("gloo: 2 process group(s) per point-to-point channel (PIPEFLOW_GLOO_GROUPS=2)") == np_
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush(model, MODELS[model], steps=3, microbatches=4, microbatch_size=2, optimizer="sgd",
                           lr=0.05, momentum=0.9)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=k)
