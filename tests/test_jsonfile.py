"""One validator for the JSON formats (partitioner/jsonfile.py: check_fields, field_problem): the field tables of
plan.json, profile.json and the checkpoint marker, with their one-line messages."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.jsonfile import check_fields, field_problem
from partitioner.plan import Plan, PlanError
from partitioner.profile import Profile, ProfileError
from pipeflow import restore
from pipeflow.checkpoint import CKPT_FORMAT, CheckpointError


def test_check_fields_names_the_first_field_that_breaks_the_table() -> None:
    table = {"n": int, "name": str, "ratio": (int, float), "tag": None, "even": lambda v: v % 2 == 0}
    good = {"n": 2, "name": "a", "ratio": 0.5, "tag": [1], "even": 4}
    assert check_fields(good, table, source="x.json", error=ValueError) is good
    for bad, message in [([], "x.json: expected a JSON object, found list"),
                         ({**good, "n": True}, "x.json: field 'n' must be int, found True"),
                         ({**good, "ratio": "1"}, "x.json: field 'ratio' must be int/float, found '1'"),
                         ({**good, "even": 3}, "x.json: field 'even' must be valid, found 3"),
                         ({k: v for k, v in good.items() if k != "tag"}, "x.json: missing field 'tag'")]:
        with pytest.raises(KeyError) as e:
            check_fields(bad, table, source="x.json", error=KeyError)  # type: ignore[arg-type]
        assert e.value.args == (message,)
    with pytest.raises(ValueError, match=r"^x.json: format is 'v0', expected 'v1'$"):
        check_fields({"format": "v0"}, {}, source="x.json", error=ValueError, format="v1")
    assert field_problem({"a": 1}, {"a": int, "b": str}, optional=("b",)) is None


def test_the_three_formats_report_through_the_one_validator(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"^p.json: field 'microbatches' must be int, found 2.5$"):
        Plan.from_json({"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 2.5, "workers": 1,
                        "stages": []}, source="p.json")
    with pytest.raises(PlanError, match=r"^p.json: missing field 'stages'$"):
        Plan.from_json({"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 2, "workers": 1},
                       source="p.json")
    with pytest.raises(ProfileError, match=r"^f.json: format is \"pipeflow.plan/1\", expected 'pipeflow.profile/1'$"):
        Profile.from_json({"format": "pipeflow.plan/1"}, source="f.json")
    for marker in [{"format": CKPT_FORMAT, "step": 1, "run": {}, "stages": [{"file": "a/b", "layers": [0, 1]}]},
                   {"format": CKPT_FORMAT, "step": 1, "run": {}, "stages": [{"file": "s0.pt", "layers": [1, 1]}]},
                   {"format": CKPT_FORMAT, "step": "1", "run": {}, "stages": [{"file": "s0.pt", "layers": [0, 1]}]},
                   {"format": CKPT_FORMAT, "step": 1, "run": {}, "stages": []}]:
        (tmp_path / "COMPLETE").write_text(json.dumps(marker))
        with pytest.raises(CheckpointError, match=r"COMPLETE: not a pipeflow.checkpoint/1 marker: expected an object "
                                                  r"with format, step, run and stages"):
            restore.read_marker(tmp_path)
    good = {"format": CKPT_FORMAT, "step": 1, "run": {}, "stages": [{"file": "s0.pt", "layers": [0, 1], "bytes": 3}]}
    (tmp_path / "COMPLETE").write_text(json.dumps(good))
    assert restore.read_marker(tmp_path) == good


def test_a_write_that_sweeps_removes_only_its_own_files_leftovers(tmp_path: Path) -> None:
    """atomic_write's temporary files (`.NAME.tmp-PID`) that killed writers left: a checkpoint's write (sweep=True)
    removes those of its own file, and nothing else; a write without sweep leaves them."""
    from partitioner.jsonfile import write_json

    mine = [".COMPLETE.tmp-12", ".COMPLETE.tmp-999999"]
    others = [".stage-000.pt.tmp-12", ".COMPLETE.tmp-12.bak", ".COMPLETE.tmp-x", "COMPLETE.tmp-12", ".COMPLETE"]
    for name in mine + others:
        (tmp_path / name).write_text("left")
    write_json(tmp_path / "COMPLETE", {"a": 1})
    assert {p.name for p in tmp_path.iterdir()} == {"COMPLETE", *mine, *others}
    write_json(tmp_path / "COMPLETE", {"a": 2}, sweep=True)
    assert {p.name for p in tmp_path.iterdir()} == {"COMPLETE", *others}
    assert json.loads((tmp_path / "COMPLETE").read_text()) == {"a": 2}
