"""Bad input to pipeflow-plan and pipeflow-profile: one line naming what was expected and found, exit 2, before
any expensive work; never a traceback, a hang or a lost result (the planner side of tests/test_bad_input.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from partitioner import cli, profiler
from partitioner.jsonfile import load_json
from partitioner.plan import Plan, PlanError, StagePlan, even_plan
from partitioner.profile import LayerProfile, Profile

LAYERS = 8


def make_profile(**kw: Any) -> Profile:
    return Profile("mlp", {"layers": LAYERS}, "cpu", "float32", 4,
                   [LayerProfile(f"l{i}", 1.0, 2.0, 100_000, 1_000_000, 4_000_000) for i in range(LAYERS)], **kw)


@pytest.fixture
def d(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding p.json (a profile), plan.json (1f1b on 2 ranks) and planI.json (interleaved, v = 2)."""
    monkeypatch.chdir(tmp_path)
    make_profile().save(tmp_path / "p.json")
    even_plan(LAYERS, 2, schedule="1f1b", microbatches=8).save(tmp_path / "plan.json")
    even_plan(LAYERS, 2, schedule="interleaved", microbatches=4, virtual_stages=2).save(tmp_path / "planI.json")
    return tmp_path


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *, main: Any = cli.main,
            prog: str = "pipeflow-plan") -> str:
    """The one line `main(argv)` refuses with (exit 2), without its 'prog: error: ' prefix."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip().removeprefix(f"{prog}: error: ")


def plan_file(path: Path, **fields: Any) -> str:
    """plan.json of 1f1b on 2 ranks with `fields` replaced."""
    path.write_text(json.dumps({**even_plan(LAYERS, 2, schedule="1f1b", microbatches=8).to_json(), **fields}))
    return str(path)


def test_output_that_is_the_input_profile_is_refused(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (d / "p.json").read_text()
    assert refused(capsys, ["p.json", "--workers", "2", "-o", "p.json"]) == (
        "-o p.json is the profile pipeflow-plan reads: the plan would overwrite it; write the plan to another file")
    (d / "link.json").hardlink_to(d / "p.json")  # one file under another name
    assert refused(capsys, ["p.json", "--workers", "2", "-o", "link.json"]).startswith("-o link.json is the profile")
    assert (d / "p.json").read_text() == before
    # --evaluate X -o X prices the plan in place
    assert cli.main(["p.json", "--evaluate", "plan.json", "-o", "plan.json"]) == 0
    assert Plan.load(d / "plan.json").predicted["step_ms"] > 0


@pytest.mark.parametrize(("timeline", "message"), [
    ("t.txt", "--timeline must end in a format matplotlib writes (.avif, .eps, .gif, .jpeg, .jpg, .pdf, .pgf, .png, "
              ".ps, .raw, .rgba, .svg, .svgz, .tif, .tiff, .webp), found 't.txt'"),
    ("plan", "--timeline must end in a format matplotlib writes"),  # savefig would write plan.png
    ("somedir", "--timeline must name a file, found the directory somedir"),
    ("missing/t.png", "--timeline must be in an existing directory, found missing/t.png (missing does not exist)"),
    ("o.json", "--timeline o.json is the plan -o writes: the drawing would overwrite it; draw to another file"),
    ("p.json", "--timeline p.json is the profile pipeflow-plan reads: the drawing would overwrite it; draw to "
               "another file"),
    ("", "--timeline must name a file, found ''"),
])
def test_timeline_path_is_checked_before_planning(d: Path, capsys: pytest.CaptureFixture[str], timeline: str,
                                                  message: str) -> None:
    (d / "somedir").mkdir()
    got = refused(capsys, ["p.json", "--workers", "2", "--microbatches", "4", "-o", "o.json", "--timeline", timeline])
    assert got.startswith(message), got
    assert not (d / "o.json").exists() and not (d / "plan.png").exists()


def test_timeline_naming_the_evaluated_plan_is_refused(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(capsys, ["p.json", "--evaluate", "plan.json", "-o", "o.json", "--timeline", "plan.json"]) == (
        "--timeline plan.json is the plan --evaluate reads: the drawing would overwrite it; draw to another file")


def test_a_drawing_that_fails_keeps_the_plan(d: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(planned: object, path: str) -> None:
        raise RuntimeError("'xelatex' not found\nsecond line")

    monkeypatch.setattr(cli, "draw", fail)
    assert cli.main(["p.json", "--workers", "2", "--microbatches", "4", "-o", "o.json", "--timeline", "t.pgf"]) == 1
    cap = capsys.readouterr()
    assert cap.err == "pipeflow-plan: error: wrote o.json but could not draw --timeline t.pgf: 'xelatex' not found\n"
    assert cap.out.splitlines()[-1] == "wrote o.json"
    assert Plan.load(d / "o.json").workers == 2


@pytest.mark.parametrize("main,prog", [(cli.main, "pipeflow-plan"), (profiler.main, "pipeflow-profile")])
def test_empty_output_path_is_refused(d: Path, capsys: pytest.CaptureFixture[str], main: Any, prog: str) -> None:
    argv = ["p.json", "--workers", "2"] if prog == "pipeflow-plan" else ["--model", "mlp", "--microbatch-size", "2"]
    assert refused(capsys, [*argv, "-o", ""], main=main, prog=prog) == "-o must name a file, found ''"


@pytest.mark.parametrize(("output", "message"), [
    ("/nonexistent-dir/p.json", "-o must be in an existing directory, found /nonexistent-dir/p.json "
                                "(/nonexistent-dir does not exist)"),
    ("somedir", "-o must name a file, found the directory somedir"),
    ("p.json/x.json", "-o must be in a directory, found p.json/x.json (p.json is not a directory)"),
])
def test_profile_output_is_checked_before_profiling(d: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch, output: str, message: str) -> None:
    (d / "somedir").mkdir()

    def no_model(*args: object, **kw: object) -> None:
        raise AssertionError("the model was built before -o was checked")

    monkeypatch.setattr(profiler, "build_model", no_model)
    argv = ["--model", "mlp", "--microbatch-size", "2", "-o", output]
    assert refused(capsys, argv, main=profiler.main, prog="pipeflow-profile") == message


def test_json_nested_too_deeply_or_with_a_huge_integer(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (d / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (d / "digits.json").write_text("1" * 5000)
    assert refused(capsys, ["deep.json", "--workers", "2", "-o", "o.json"]) == (
        "deep.json: arrays or objects nested too deeply to read (at most about 1000 levels); expected profile.json")
    assert refused(capsys, ["p.json", "--evaluate", "deep.json", "-o", "o.json"]).endswith("expected plan.json")
    assert refused(capsys, ["digits.json", "--workers", "2", "-o", "o.json"]) == (
        "digits.json: holds an integer of more than 4300 digits; expected profile.json")
    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):  # its callers catch JSONDecodeError
        load_json(d / "deep.json")
    with pytest.raises(json.JSONDecodeError, match="^holds an integer of more than 4300 digits"):
        load_json(d / "digits.json")


@pytest.mark.parametrize(("fields", "message"), [
    ({"workers": 10**400}, "plan.workers=100000000000000000000000000000000000000000000000000000000... but the "
                           "stages' ranks are [0, 1]; expected each of 0..999999999999999999999999999999999999999999"
                           "999999999999999... exactly once"),
    ({"workers": 10**10}, "plan.workers=10000000000 but the stages' ranks are [0, 1]; expected each of 0..9999999999 "
                          "exactly once"),
    ({"workers": 0}, "plan.workers must be >= 1, found 0"),
    ({"microbatches": 5000}, "plan.microbatches must be at most 4096 (the planner's limit), found 5000"),
])
def test_plan_numbers_are_checked_by_value_and_named_by_field(d: Path, capsys: pytest.CaptureFixture[str],
                                                              fields: dict[str, Any], message: str) -> None:
    path = plan_file(d / "bad.json", **fields)
    assert refused(capsys, ["p.json", "--evaluate", path, "-o", "o.json"]) == f"{path}: {message}"


@pytest.mark.parametrize("warmup", [[10**400, 0], [9, 0]])
def test_warmup_counts_past_the_microbatches_read_as_the_microbatches(d: Path, warmup: list[int]) -> None:
    """A stage runs at most m forwards before its first backward; earlier pipeflow-plan versions wrote counts past m."""
    assert Plan.load(plan_file(d / "w.json", warmup=warmup)).warmup == [8, 0]


def test_a_plan_of_60000_ranks_is_refused_at_once(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n = 60_000
    path = plan_file(d / "big.json", workers=n, stages=[{"layers": [0, LAYERS], "replicas": n, "ranks": [*range(n)]}])
    assert refused(capsys, ["p.json", "--evaluate", path, "-o", "o.json"]) == (
        f"{path}: plan.workers must be at most 1024 (the planner's limit), found 60000")
    with pytest.raises(PlanError) as e:  # each rank twice: the list is cut short
        Plan("1f1b", 8, n, [StagePlan((0, LAYERS), n, [*range(n // 2)] * 2)])
    assert str(e.value) == ("plan lists ranks [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16... "
                            "more than once; every rank must appear exactly once")


def test_profile_numbers_past_float_range_are_refused(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = make_profile().to_json()
    doc["layers"][1]["output_bytes"] = 10**400
    (d / "huge.json").write_text(json.dumps(doc))
    assert refused(capsys, ["huge.json", "--workers", "2", "-o", "o.json"]) == (
        "huge.json: layers[1].output_bytes must be at most 1.15292e+18 (bytes), found "
        "100000000000000000000000000000000000000000000000000000000...")
    doc = {**make_profile().to_json(), "microbatch_size": 10**400}
    (d / "huge.json").write_text(json.dumps(doc))
    assert refused(capsys, ["huge.json", "--workers", "2", "-o", "o.json"]).startswith(
        "huge.json: microbatch_size must be at most 1.15292e+18, found 1000000")


@pytest.mark.parametrize(("args", "message"), [
    (["--workers", "2", "--virtual-stages", "0"], "--virtual-stages must be >= 1, found 0"),
    (["--layers-per-stage", "4,4", "--microbatches", "4", "--virtual-stages", "-1"],
     "--virtual-stages must be >= 1, found -1"),
    (["--layers-per-stage", "even", "--workers", "2", "--microbatches", "4", "--schedule", "interleaved",
      "--virtual-stages", "0"], "--virtual-stages must be >= 1, found 0"),
    (["--workers", "2", "--schedule", "1f1b", "--virtual-stages", "3"],
     "--virtual-stages 3 needs a schedule that places chunks round-robin (interleaved), found --schedule 1f1b"),
    (["--workers", "2", "--virtual-stages", "3"],
     "--virtual-stages 3 needs a schedule that places chunks round-robin (interleaved), found --schedule 1f1b"),
    (["--evaluate", "planI.json", "--virtual-stages", "3"],
     "--virtual-stages 3 differs from the plan's 2 (planI.json); drop --virtual-stages to evaluate the plan as "
     "written"),
    (["--evaluate", "plan.json", "--virtual-stages", "2"],
     "--virtual-stages 2 needs a schedule that places chunks round-robin (interleaved), found --schedule 1f1b"),
    (["--evaluate", "plan.json", "--microbatches", "09"],
     "--microbatches 9 differs from the plan's 8 (plan.json); drop --microbatches to evaluate the plan as written"),
    (["--layers-per-stage", "even", "--workers", "0", "--microbatches", "4"],
     "--workers must be a positive integer, found 0"),
    (["--layers-per-stage", "even", "--workers", "-1", "--microbatches", "4"],
     "--workers must be a positive integer, found -1"),
    (["--workers", "2", "--topology", "2x1e-320GB/s"],
     "--topology '2x1e-320GB/s': bandwidth must be at least 1kB/s (every network link is faster), found '1e-320GB/s'"),
    (["--workers", "2", "--topology", "2x1e-30GB/s"],
     "--topology '2x1e-30GB/s': bandwidth must be at least 1kB/s (every network link is faster), found '1e-30GB/s'"),
    (["--workers", "2", "--topology", "\u0968x10GB/s"],  # Devanagari 2
     "--topology must be comma-separated levels COUNTxBANDWIDTH such as 8x300GB/s,4x25GB/s (innermost first), "
     "found '\u0968x10GB/s'"),
    (["--workers", "2", "--microbatches", "\uff18"], "--microbatches must be a positive integer or 'auto', found "
                                                     "'\uff18'"),  # fullwidth 8
])
def test_flags_refused_in_one_line(d: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                   message: str) -> None:
    assert refused(capsys, ["p.json", *args, "-o", "o.json"]) == message
    assert not (d / "o.json").exists()


def test_evaluate_compares_flags_by_value(d: Path) -> None:
    assert cli.main(["p.json", "--evaluate", "plan.json", "--microbatches", "08", "-o", "o.json"]) == 0
    assert cli.main(["p.json", "--evaluate", "planI.json", "--virtual-stages", "2", "-o", "o.json"]) == 0


@pytest.mark.parametrize(("fields", "message"), [
    ({"link_bandwidth": 1e-300}, "link_bandwidth must be a number of bytes/s from 1000 (1 kB/s) to below "
                                 "1.15292e+18, found 1e-300"),
    ({"other_microbatch_sizes": [{**make_profile().to_json(), "microbatch_size": 8, "model": "gpt"}]},
     "other_microbatch_sizes[0]: model must be the top level's \"mlp\" (the same model at another microbatch size), "
     "found \"gpt\""),
    ({"other_microbatch_sizes": [{**make_profile().to_json(), "microbatch_size": 8, "dtype": "bfloat16"}]},
     "other_microbatch_sizes[0]: dtype must be the top level's \"float32\" (the same model at another microbatch "
     "size), found \"bfloat16\""),
])
def test_profile_fields_out_of_range(d: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, Any],
                                     message: str) -> None:
    (d / "bad.json").write_text(json.dumps({**make_profile().to_json(), **fields}))
    assert refused(capsys, ["bad.json", "--workers", "2", "-o", "o.json"]) == f"bad.json: {message}"


def test_evaluate_refuses_warmup_counts_that_deadlock(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The replay finds the deadlock: one line, as pipeflow-train refuses the same plan (it was a traceback)."""
    assert refused(capsys, ["p.json", "--evaluate", plan_file(d / "w.json", warmup=[0, 3]), "-o", "o.json"]) == (
        "the plan cannot run: warmup [0, 3]: deadlock: worker 0 at B0, worker 1 at F1 can never proceed")
    assert not (d / "o.json").exists()
