"""Tensor trees through torch.utils._pytree and JSON files through partitioner.jsonfile (issue 12).

Pure tests (no mpirun): the walkers keep their contracts (stage outputs travel as tensors and a structure, a batch's
tuples/lists reach the first stage as tuples, non-tensors pass untouched), the loader's collate stays ours (it
differs from torch's default_collate, pinned below), and plan/profile/marker files are replaced atomically.
"""
from __future__ import annotations

import ast
import json
import os
import pickle
import threading
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from partitioner.jsonfile import write_json
from partitioner.measure import map_tensors as _map
from partitioner.measure import tensors
from partitioner.plan import even_plan
from pipeflow.data.loader import MicrobatchLoader, collate
from pipeflow.stage import _cast_floats, to_device
from pipeflow.structure import OutputError, join, split

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
Pair = namedtuple("Pair", "a b")


def test_a_stage_output_is_sent_depth_first_and_rebuilt_as_it_was() -> None:
    """structure.split / join: the tensors travel depth first; the structure around them (nested tuples and lists,
    dicts, None and other constants) is rebuilt for the next stage's first layer (before, a dict or a None was
    refused mid-run and a nested tuple arrived flat)."""
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    out, tree = split((a, [b, (c,)], d))
    assert len(out) == 4 and all(x is y for x, y in zip(out, (a, b, c, d)))
    assert join(out, tree) == (a, [b, (c,)], d)
    assert split(a) == ([a], None) and split((a, b)) == ([a, b], None)  # a flat tuple needs no structure
    for named in (Pair(a, b), Pair(a, (b,))):  # a named tuple of a module arrives as itself, flat or nested
        tensors, tree = split(named)
        again = join(list(tensors), pickle.loads(pickle.dumps(tree)))
        assert type(again) is Pair and repr(again) == repr(named)
    for given in ({"h": a, "mask": b}, (a, None), (a, 3, "x", True, 1.5), [a], (a,)):
        tensors, tree = split(given)
        again = join(list(tensors), pickle.loads(pickle.dumps(tree)))  # the tree travels pickled, with the shapes
        assert type(again) is type(given) and repr(again) == repr(given), given
    with pytest.raises(OutputError, match=r"^a stage's output may hold tensors and None, bool, int, float or str in "
                                        r"tuples, lists and dicts; found set$"):
        split((a, {1}))


def test_one_tensor_returned_twice_travels_once_and_arrives_as_one() -> None:
    """(h, h): before, two buffers arrived, and an in-place change to one was not seen in the other."""
    a, b = torch.zeros(2), torch.ones(2)
    for given, sent in [((a, a), [a]), ((a, b, a), [a, b]), ({"h": a, "skip": (b, a), "n": 3}, [a, b]),
                        ([b, a, b, None], [b, a])]:
        tensors, tree = split(given)
        assert len(tensors) == len(sent) and all(x is y for x, y in zip(tensors, sent)), given
        copies = [t.clone() for t in tensors]  # as received: new buffers
        again = join(copies, pickle.loads(pickle.dumps(tree)))
        assert repr(again) == repr(given) and type(again) is type(given), given
        leaves = [x for x in torch.utils._pytree.tree_leaves(again) if isinstance(x, torch.Tensor)]
        assert {id(x) for x in leaves} == {id(c) for c in copies}, given  # each sent tensor, wherever it was
    pair = join([torch.zeros(2)], split((a, a))[1])
    pair[0].add_(1.0)
    assert pair[1].tolist() == [1.0, 1.0]


def test_first_stage_input_lists_become_tuples_and_non_tensors_pass() -> None:
    x, y = torch.ones(2, dtype=torch.float64), torch.arange(3)
    marker = {"k": torch.zeros(1)}
    moved = to_device([x, [y, 7], Pair(x, y), marker], CPU)
    assert type(moved) is tuple and type(moved[1]) is tuple and type(moved[2]) is tuple
    assert moved[1][1] == 7 and type(moved[3]) is dict and list(moved[3]) == ["k"]  # a dict input is walked into
    torch.testing.assert_close(moved[0], x)
    cast = _cast_floats(moved, torch.float32)
    assert cast[0].dtype == torch.float32 and cast[1][0].dtype == torch.int64 and cast[2][1] is moved[2][1]
    assert _cast_floats({"k": x}, torch.float32)["k"].dtype == torch.float32  # its floats cast to the model's
    assert to_device(5, CPU) == 5 and _cast_floats("s", torch.float32) == "s"


def test_profiler_walkers_keep_containers_and_skip_non_tensors() -> None:
    a, b = torch.ones(1), torch.zeros(2)
    assert [t.shape[0] for t in tensors((a, [b, None, 3]))] == [1, 2]
    out = _map([a, (b, "x"), Pair(a, b)], lambda t: t + 1)
    assert type(out) is list and type(out[1]) is tuple and out[1][1] == "x" and type(out[2]) is Pair
    torch.testing.assert_close(out[2].b, torch.ones(2))


def test_loader_collate_differs_from_default_collate_as_documented() -> None:
    """Why pipeflow keeps its own collate: default_collate turns tuples into lists and Python floats into
    float64 tensors (ours: tuples, the default dtype), and passes strings through instead of refusing them.
    On tensor samples (every built-in and test dataset) the (input, target) pair is the same."""
    samples = [(torch.randn(3), torch.tensor(i)) for i in range(4)]
    ours, theirs = collate(samples), default_collate(samples)
    assert type(ours) is tuple and type(theirs) is list
    for o, t in zip(ours, theirs):
        assert torch.equal(o, t)
    floats = [(1.5, (torch.ones(1), 2)), (2.5, (torch.zeros(1), 3))]
    ours, theirs = collate(floats), default_collate(floats)
    assert ours[0].dtype == torch.get_default_dtype() and theirs[0].dtype == torch.float64
    assert type(ours[1]) is tuple and type(theirs[1]) is list
    assert torch.equal(ours[1][1], torch.tensor([2, 3]))
    with pytest.raises(TypeError, match="cannot batch samples of type str"):
        collate(["a", "b"])
    assert default_collate(["a", "b"]) == ["a", "b"]
    # a dict input (Hugging Face style) is batched key by key, in the first sample's key order, as torch does
    dicts = [({"ids": torch.tensor([i, i]), "scale": 0.5 * i}, i) for i in range(3)]
    ours, theirs = collate(dicts), default_collate(dicts)
    assert list(ours[0]) == list(theirs[0]) == ["ids", "scale"]
    for k in ("ids", "scale"):
        assert torch.equal(ours[0][k], theirs[0][k].to(ours[0][k].dtype))
    with pytest.raises(TypeError, match=r"samples of one microbatch must have the same dict keys: expected \['ids', "
                                        r"'scale'\], found \['ids'\]"):
        collate([{"ids": torch.ones(1), "scale": 1.0}, {"ids": torch.ones(1)}])


def test_loader_signature_reads_a_dict_input_s_tensors_in_key_order() -> None:
    data = [({"ids": torch.ones(5, dtype=torch.long), "mask": torch.ones(5, dtype=torch.bool), "s": 1.0}, 0)] * 4
    assert MicrobatchLoader(data, 2).signature(1) == ((2, 5), (2, 5), (2,))


def test_loader_signature_counts_numbers_as_scalars() -> None:
    data = [((torch.ones(2, 3), 4.0), torch.tensor(0))] * 5
    loader = MicrobatchLoader(data, 2, shuffle=False)  # type: ignore[arg-type]
    assert loader.signature(0) == ((2, 2, 3), (2,))


def test_write_json_replaces_the_file_a_reader_holds_open(tmp_path: Path) -> None:
    """Rename, not rewrite: a reader that opened the old plan reads all of it, whatever a save does meanwhile
    (before: write_text truncated the same file under the reader)."""
    path = tmp_path / "plan.json"
    even_plan(4, 2, schedule="gpipe", microbatches=2).save(path)
    old = path.read_text()
    with open(path) as reader:
        even_plan(4, 4, schedule="gpipe", microbatches=2).save(path)
        assert reader.read() == old
    assert path.read_text() != old and '"workers": 4' in path.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_write_json_failure_keeps_old_file_and_names_the_path(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "profile.json"
    write_json(path, {"old": 1})

    real, this_thread = os.fsync, threading.get_ident()

    def full(fd: int) -> None:  # a full disk for this test's thread only (conftest.in_background runs others)
        if threading.get_ident() != this_thread:
            return real(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"^\[Errno 28\] No space left on device: '.*/profile\.json'$"):
        write_json(path, {"new": 2})
    with pytest.raises(OSError, match=r"^\[Errno 2\] No such file or directory: '.*/nowhere/plan\.json'$"):
        write_json(tmp_path / "nowhere" / "plan.json", {})
    monkeypatch.undo()
    assert path.read_text() == '{\n "old": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


# Hand-written recursive walkers over tensor trees are replaced by torch.utils._pytree; these are the
# only functions allowed to test for (tuple, list) themselves: leaf predicates handed to pytree, the
# structure-only list -> tuple of the first stage's input, and the loader's collate (kept: see above).
ALLOWED = {("pipeflow/comm.py", "_not_sequence"), ("partitioner/measure.py", "_not_sequence"),
           ("pipeflow/stage.py", "_as_tuples"), ("pipeflow/data/loader.py", "collate"),
           ("pipeflow/data/loader.py", "_tensors")}


def test_write_json_through_a_symlink_replaces_its_target(tmp_path: Path) -> None:
    """An output path that is a symbolic link keeps the link; the file it points to gets the new JSON."""
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    write_json(link, {"a": 1})
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}


def test_no_new_hand_written_tree_walkers() -> None:
    found = set()
    for package in ("pipeflow", "partitioner", "launch"):
        for file in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(file.read_text())
            for fn in ast.walk(tree):
                if not isinstance(fn, ast.FunctionDef):
                    continue
                for node in ast.walk(fn):
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                            and node.func.id == "isinstance" and len(node.args) == 2
                            and isinstance(node.args[1], ast.Tuple)
                            and {getattr(e, "id", None) for e in node.args[1].elts} == {"tuple", "list"}):
                        found.add((file.relative_to(ROOT).as_posix(), fn.name))
    assert found <= ALLOWED, f"walk tensor trees with torch.utils._pytree instead: {sorted(found - ALLOWED)}"


def test_a_view_inside_another_output_travels_inside_it_and_is_rebuilt_as_its_view():
    """(h, h[:, 0], h.t(), h[1:]): one tensor sent, the others rebuilt on it, an in-place change to one seen in all, as
    in one process. Apart, as before: a view of a non-contiguous tensor, one needing a gradient its holder does not
    carry, and one whose gradient is not just the holder's where its elements lie: made by a custom Function (a
    gradient-reversal layer), read by a hook, or made by more than one operation."""
    from pipeflow.received import received
    from pipeflow.structure import join, split
    from tests.models_grads import Reverse

    h = torch.arange(12.0).reshape(3, 4).requires_grad_(True) * 1
    sent, tree = split((h, h[:, 0], h.t(), h[1:]))
    assert len(sent) == 1 and sent[0] is h and tree is not None
    leaf = sent[0].detach().clone().requires_grad_(True)  # what the next stage receives
    got = join(received([leaf]), tree)
    assert [tuple(t.shape) for t in got] == [(3, 4), (3,), (4, 3), (2, 4)]
    assert all(torch.equal(a, b) for a, b in zip(got, (h, h[:, 0], h.t(), h[1:])))
    got[1].mul_(10)  # the first column, seen through every other output
    assert got[0][:, 0].tolist() == [0.0, 40.0, 80.0] and got[2][0].tolist() == [0.0, 40.0, 80.0]
    (got[0].sum() + got[3].sum()).backward()
    assert leaf.grad is not None and leaf.grad[:, 0].tolist() == [10.0, 20.0, 20.0]

    hooked = h[:, 0]
    hooked.register_hook(lambda g: 5 * g)
    t = h.t()  # not contiguous: its view travels apart
    for apart in ((t, t[0]), (h.detach(), h[:, 0]), (h, Reverse.apply(h)), (h, hooked), (h, h[1:].t())):
        assert len(split(apart)[0]) == 2
    assert len(split((h, h.detach()[:, 0]))[0]) == 1  # a detached view of h: inside h, no gradient
