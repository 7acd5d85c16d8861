"""Stage outputs with structure (pipeflow/structure.py): a dict holding a tensor, a pair with None and an int, then
(tensor, None), cross stage boundaries and reach the next layer as the layer returned them, so the run equals one
process. Before, the runtime refused a dict or a None mid-run with a traceback ("stage outputs must be tensors or
tuples of tensors"), after planning on the spot had accepted them, and flattened nested tuples."""
from __future__ import annotations

from pathlib import Path

import pytest

from partitioner.profiler import profile_model
from pipeflow.spec import build_model
from tests.conftest import Case, MpiRun, batched, in_background, run_mpi
from tests.reference import reference_delayed
from tests.test_seams_grads import SMALL, B, assert_same, reference, saved, train

MODEL = "tests.models_grads:structured"
OPT = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01"]
STAGES = {"1f1b": [(1, 1), (1, 2), (1, 1)], "async": [(1, 1), (1, 1), (1, 1)]}


def test_the_profiler_accepts_what_a_stage_can_send() -> None:
    prof = profile_model(build_model(MODEL, SMALL), 4, "cpu", warmup=0, repeats=1)
    assert [lay.name for lay in prof.layers] == ["0:Named", "1:Unpack", "2:First"]
    assert prof.layers[0].output_bytes == 2 * 4 * 8 * 4  # its two tensors (float32), not the None or the int


def structured_runs(d: Path, schedule: str) -> Case:
    return train(d, MODEL, SMALL, STAGES[schedule], schedule=schedule, m=4, steps=3, extra=OPT)


@pytest.mark.parametrize("schedule", sorted(STAGES))
@batched(structured_runs)
def test_dicts_none_and_nested_tuples_between_stages_train_as_one_process(mpi: MpiRun, schedule: str) -> None:
    if schedule == "1f1b":
        want = reference(MODEL, SMALL, steps=3, microbatches=4, optimizer="adamw", lr=0.01, weight_decay=0.01)
    else:
        want = reference_delayed(MODEL, SMALL, schedule="async", stages=STAGES["async"], steps=3, microbatches=4,
                                 microbatch_size=B, optimizer="adamw", lr=0.01)
    assert_same(saved(mpi), want)


DICT_STAGES = {"split": [(1, 1), (3, 1)], "replicated": [(1, 2), (3, 1)], "middle": [(2, 1), (2, 1)],
               "async": [(1, 1), (3, 1)]}


def dict_input_runs(d: Path, stages: str) -> Case:
    schedule = "async" if stages == "async" else "1f1b"
    return train(d, "tests.models:dict_input", {}, DICT_STAGES[stages], schedule=schedule, m=4, steps=3, extra=OPT)


@pytest.mark.parametrize("stages", sorted(DICT_STAGES))
@batched(dict_input_runs)
def test_a_dict_input_trains_as_one_process(mpi: MpiRun, stages: str) -> None:
    """Samples ({"input_ids", "attention_mask", "scale"}, label), as Hugging Face datasets give: the loader batches
    the dict key by key, the first stage gets it on its device with the float scale in the model's dtype (async:
    as its delayed reference). Before, the model was refused at set-up ("cannot batch samples of type dict")."""
    if stages == "async":
        want = reference_delayed("tests.models:dict_input", {}, schedule="async", stages=DICT_STAGES[stages],
                                 steps=3, microbatches=4, microbatch_size=B, optimizer="adamw", lr=0.01)
    else:
        want = reference("tests.models:dict_input", {}, steps=3, microbatches=4, optimizer="adamw", lr=0.01,
                         weight_decay=0.01)
    assert_same(saved(mpi), want)


@in_background
def test_an_output_no_stage_can_send_on_a_split_by_hand_stops_in_one_line() -> None:
    """The profiler never saw the layers of a split given by hand: a set in a stage's output is refused at the first
    forward, in one line naming the layer, exit 2. Before, a TypeError's traceback and exit 1."""
    proc = run_mpi(2, ["--model", "tests.models_grads:unsendable", "--device", "cpu", "--layers-per-stage", "1,1",
                       "--steps", "2", "--microbatches", "2"], timeout=120, check=False)
    lines = [line for line in proc.stderr.splitlines() if "pipeflow-train" in line]
    assert proc.returncode == 2 and lines == [
        "pipeflow-train: error: [rank 0] layer 0 (Tagged), the last of its stage: a stage's output may hold tensors "
        "and None, bool, int, float or str in tuples, lists and dicts; found set"], proc.stderr
    assert "Traceback" not in proc.stderr


def twice_runs(d: Path, pair: str) -> Case:
    return train(d, "tests.models_grads:returned_twice", {**SMALL, "view_first": pair == "view_first"},
                 [(1, 1), (2, 1)], schedule="1f1b", m=4, steps=3, extra=OPT)


@pytest.mark.parametrize("pair", ["twice", "view_first"])
@batched(twice_runs)
def test_a_tensor_returned_twice_arrives_as_one_as_in_one_process(mpi: MpiRun, pair: str) -> None:
    """Layer 0 returns (h, h), or (h.view(h.shape), h); the next stage's layer doubles the first in place, and in one
    process the second with it. Before, (h, h) arrived as two buffers (the second stayed as it was and the run
    trained other weights), and the whole view before its base was refused as a change to a tensor sent apart."""
    want = reference("tests.models_grads:returned_twice", {**SMALL, "view_first": pair == "view_first"}, steps=3,
                     microbatches=4, optimizer="adamw", lr=0.01, weight_decay=0.01)
    assert_same(saved(mpi), want)


def named_runs(d: Path, nested: str) -> Case:
    args = {**SMALL, "nested": nested == "nested"}
    return train(d, "tests.models_grads:named_outputs", args, [(1, 1), (1, 1), (2, 1)], schedule="1f1b", m=4,
                 steps=3, extra=OPT)


@pytest.mark.parametrize("nested", ["flat", "nested"])
@batched(named_runs)
def test_a_named_tuple_arrives_as_itself(mpi: MpiRun, nested: str) -> None:
    """The next stage's layer reads it by field name. A flat one arrived as a plain tuple ("'tuple' object has no
    attribute 'hidden'", a traceback on that rank); a nested one was refused."""
    want = reference("tests.models_grads:named_outputs", {**SMALL, "nested": nested == "nested"}, steps=3,
                     microbatches=4, optimizer="adamw", lr=0.01, weight_decay=0.01)
    assert_same(saved(mpi), want)


def test_a_named_tuple_defined_in_a_function_is_refused_nested_and_sent_flat_as_a_tuple() -> None:
    from collections import namedtuple

    import torch

    from pipeflow.structure import OutputError, join, split

    Local = namedtuple("Local", ["a", "b"])  # noqa: PYI024
    h = torch.ones(2, 3)
    sent, tree = split(Local(h, 2 * h))
    assert tree is None and len(sent) == 2 and type(join(sent, tree)) is tuple  # as before: a plain tuple
    with pytest.raises(OutputError) as e:
        split((Local(h, 2 * h), h + 1))
    assert str(e.value) == (
        "a stage's output holds the named tuple tests.test_structured_outputs:Local around other containers, which the "
        "next stage cannot import by that name (a class defined inside a function): define it at module level, or "
        "return tuples, lists and dicts")


def test_a_constant_that_depends_on_the_data_is_named_as_such() -> None:
    """A layer returning (h, float(h.mean())): the constant travels once per input shape, and a change stopped the run
    saying the tensors changed "from [(2, 8) float64] to [(2, 8) float64]"."""
    import torch

    from pipeflow.structure import shape_change, split

    h = torch.ones(2, 8, dtype=torch.float64)
    metas = [([((2, 8), torch.float64, False)], split((h, value))[1]) for value in (0.25, 0.5)]
    assert str(shape_change(1, *metas, "[(2, 6) float64]")) == (
        "what is sent to rank 1 beside the tensors [(2, 8) float64] changed for inputs of the same shapes [(2, 6) "
        "float64]: its structure or a constant (None, bool, int, float, str), which must not depend on the data: "
        "return a value computed from it as a tensor")
