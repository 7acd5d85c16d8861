"""pipeflow-profile --ranks-per-host N: the model's passes timed alone and while N - 1 companions run the model, as a
host's other ranks do in training (profile.json `contention`, issue 13), and the companions gone when it is done."""
from __future__ import annotations

import json
import os

import pytest

from partitioner.companion import CompanionError, companion_devices
from partitioner.profile import Profile, ProfileError
from partitioner.profiler import main, profile_model
from pipeflow.spec import build_model

WITNESS = "tests.models:witness_mlp"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_contention_is_timed_beside_a_companion_between_two_passes_alone(tmp_path):
    """The layers are timed alone; then the model's passes alone, beside a companion running the model, and alone
    again; the ratio is the profile's contention, and the companion is gone when the profile is done."""
    log = tmp_path / "witness.log"
    spec = build_model(WITNESS, {"log": str(log)})
    prof = profile_model(spec, 4, "cpu", warmup=1, repeats=3, optimizer=None, threads=1, ranks_per_host=2)
    lines = [(int(p), float(t)) for p, t in (x.split() for x in log.read_text().splitlines())]
    mine = [t for p, t in lines if p == os.getpid()]
    others = {p for p, _ in lines if p != os.getpid()}
    assert mine and len(others) == 1, lines[:5]
    (pid,) = others
    theirs = [t for p, t in lines if p == pid]
    # this process ran forwards before the companion's first (the layers, a pass alone) and after its last (a
    # pass alone again), and the companion stopped with the profile
    assert min(mine) < min(theirs) and max(theirs) < max(mine)
    assert _gone(pid)
    assert prof.ranks_per_host == 2 and prof.contention is not None and prof.contention > 0
    back = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    assert (back.ranks_per_host, back.contention) == (2, prof.contention)


def test_alone_by_default_writes_no_ranks_per_host(tmp_path):
    log = tmp_path / "witness.log"
    prof = profile_model(build_model(WITNESS, {"log": str(log)}), 4, "cpu", warmup=0, repeats=1, optimizer=None)
    assert {int(x.split()[0]) for x in log.read_text().splitlines()} == {os.getpid()}
    assert prof.ranks_per_host is None and prof.contention is None
    assert "ranks_per_host" not in prof.to_json() and "contention" not in prof.to_json()


def test_a_companion_that_fails_stops_the_profiler_with_its_error(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = {"log": str(tmp_path / "w.log"), "only_pid": os.getpid()}  # the companion cannot build it
    rc = main(["--model", WITNESS, "--model-args", json.dumps(args), "--microbatch-size", "4", "--ranks-per-host", "2",
               "--repeats", "1", "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not out.exists()
    assert len(err) == 1 and err[0].startswith(
        "pipeflow-profile: error: --ranks-per-host 2: the companion on cpu failed (exit 1): ModelError: "), err
    assert err[0].endswith(f"ValueError: built in process {err[0].split('built in process ')[1].split(',')[0]}, "
                           f"only {os.getpid()} may build it")


def test_a_companion_that_stops_early_is_a_warning(tmp_path):
    warnings: list[str] = []
    spec = build_model(WITNESS, {"log": str(tmp_path / "w.log"), "die_unless_pid": os.getpid()})
    prof = profile_model(spec, 4, "cpu", warmup=1, repeats=3, optimizer=None, threads=1, ranks_per_host=2,
                         warnings=warnings)
    assert prof.ranks_per_host == 2
    assert ("the companion on cpu stopped before the profile ended (exit 3: this process gives up): the layers "
            "timed after it were timed without it") in warnings  # (with the repeats' spread, the noise warning)


def test_bad_ranks_per_host(tmp_path, capsys):
    rc = main(["--model", "mlp", "--microbatch-size", "4", "--ranks-per-host", "0", "-o", str(tmp_path / "p.json")])
    assert rc == 2
    assert capsys.readouterr().err.strip() == "pipeflow-profile: error: --ranks-per-host must be >= 1, found 0"


def test_companion_devices():
    assert companion_devices("cpu", None, 3, 0) == ["cpu"] * 3
    assert companion_devices("cuda", None, 1, 2) == ["cuda:1"]
    assert companion_devices("cuda", 1, 2, 4) == ["cuda:2", "cuda:3"]
    assert companion_devices("cuda", 3, 1, 4) == ["cuda:0"]
    with pytest.raises(CompanionError, match=r"^--ranks-per-host 2 on cuda needs 2 GPUs, one per rank, but 1 is "
                                             r"visible$"):
        companion_devices("cuda", 0, 1, 1)


def test_ranks_per_host_is_validated_in_the_file():
    prof = build_profile()
    with pytest.raises(ProfileError, match=r"^p\.json: ranks_per_host must be a positive integer, found 0$"):
        Profile.from_json({**prof.to_json(), "ranks_per_host": 0}, source="p.json")


def build_profile() -> Profile:
    return profile_model(build_model("mlp", {"layers": 2, "hidden": 8}), 2, "cpu", warmup=0, repeats=1,
                         optimizer=None)
