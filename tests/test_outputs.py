"""Output paths: checked before the model is built, the --checkpoint-dir lock, a full disk while checkpointing,
and a final --save that fails without losing the weights. Disk-full and read-only cases mount a tmpfs (root)."""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from pipeflow.models import mlp
from pipeflow.outputs import CheckpointLock, OutputError, check_outputs, write_model
from pipeflow.spec import ModelSpec
from tests.conftest import Case, MpiRun, batched
from tests.reference import reference_flush

# Stage files and the model of this mlp (float64, 64 wide) are well over the 64 KiB of the tiny filesystem.
MLP = {"layers": 4, "hidden": 64, "d_in": 8, "samples": 256}
COMMON = ["--model", "mlp", "--model-args", json.dumps(MLP), "--layers-per-stage", "even", "--microbatches", "2",
          "--microbatch-size", "2", "--optimizer", "adam", "--lr", "0.01", "--dtype", "float64", "--device", "cpu",
          "--timeout", "60"]


def watched_mlp(built: str, **kw: int) -> ModelSpec:
    """The mlp, leaving a file at `built` when it is built: set-up errors must come before that."""
    Path(built).touch()
    return mlp.build(**kw)


def messages(stderr: str) -> set[str]:
    """The distinct pipeflow-train lines, without the rank prefix (whether one rank or all print them)."""
    parts = [p.strip() for p in stderr.split("pipeflow-train: ")[1:]]
    return {re.sub(r"^error: (\[rank \d+\] )?", "", p.splitlines()[0]) for p in parts}


def mount_tmpfs(d: Path, options: str) -> Path:
    d.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the disk-full and read-only cases need a tmpfs")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root with CAP_SYS_ADMIN): {proc.stderr.strip()}")
    return d


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB filesystem: a disk that fills up."""
    d = mount_tmpfs(tmp_path / "tiny", "size=64k")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture
def read_only_fs(tmp_path):
    d = mount_tmpfs(tmp_path / "ro", "ro,size=64k")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


# ------------------------------------------------------------------------------ in one process


def outputs(**kw: str) -> Namespace:
    return Namespace(**{"save": None, "trace": None, "tensorboard": None, "checkpoint_dir": None, **kw})


@pytest.mark.parametrize("flag, path, why", [
    ("save", "{t}/missing/model.pt", "directory {t}/missing does not exist; create it first"),
    ("save", "{t}", "is a directory; expected a file name in it (e.g. {t}/model.pt)"),
    ("save", "{t}/afile/model.pt", "{t}/afile is a file, not a directory"),
    ("trace", "{t}", "is a directory; expected a file name in it (e.g. {t}/trace.json)"),
    ("trace", "/proc/trace.json", "cannot create files in /proc: No such file or directory"),
    ("tensorboard", "{t}/afile/tb", "{t}/afile is a file, not a directory"),
    ("tensorboard", "/proc/pipeflow/tb", "cannot create files in /proc: No such file or directory"),
    ("checkpoint_dir", "{t}/afile", "is a file; expected a directory"),
    ("checkpoint_dir", "{t}/afile/ck", "{t}/afile is a file, not a directory"),
    ("checkpoint_dir", "/proc/ck", "cannot create files in /proc: No such file or directory"),
])
def test_bad_output_path_is_one_line_naming_flag_path_and_reason(tmp_path, flag, path, why):
    (tmp_path / "afile").write_text("x")
    path, why = path.format(t=tmp_path), why.format(t=tmp_path)
    with pytest.raises(OutputError) as e:
        check_outputs(outputs(**{flag: path}))
    assert str(e.value) == f"--{flag.replace('_', '-')} {path}: {why}"


@pytest.mark.parametrize("flag, path", [("save", "model.pt"), ("trace", "t.json"), ("tensorboard", "runs/tb"),
                                        ("checkpoint_dir", "ck")])
def test_read_only_filesystem_is_refused(read_only_fs, flag, path):
    with pytest.raises(OutputError) as e:
        check_outputs(outputs(**{flag: str(read_only_fs / path)}))
    name = f"--{flag.replace('_', '-')}"
    assert str(e.value) == f"{name} {read_only_fs / path}: cannot create files in {read_only_fs}: Read-only file system"


def test_good_output_paths_pass_and_leave_nothing_behind(tmp_path):
    check_outputs(outputs(save=str(tmp_path / "m.pt"), trace=str(tmp_path / "t.json"),
                          tensorboard=str(tmp_path / "runs" / "tb"), checkpoint_dir=str(tmp_path / "ck")))
    assert list(tmp_path.iterdir()) == []


def test_failed_save_without_checkpoint_dir_goes_to_the_working_directory(tiny_fs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = {"0.weight": torch.arange(20000, dtype=torch.float64)}  # 160 kB: more than the disk holds
    line = write_model(state, str(tiny_fs / "model.pt"), None)
    m = re.fullmatch(rf"--save {tiny_fs}/model\.pt failed \(No space left on device\); the trained weights were "
                     rf"written to {tmp_path}/(model-rescued-\d+\.pt) instead", line or "")
    assert m, line
    assert torch.equal(torch.load(tmp_path / m.group(1), weights_only=True)["0.weight"], state["0.weight"])
    assert list(tiny_fs.iterdir()) == []  # the atomic write removed its partial temporary file


def test_save_through_a_symlink_writes_its_target(tmp_path):
    """The atomic write (temporary file, rename) must not replace a symlinked --save with a file."""
    (tmp_path / "real").mkdir()
    link = tmp_path / "model.pt"
    link.symlink_to(tmp_path / "real" / "model.pt")
    check_outputs(outputs(save=str(link)))
    assert write_model({"w": torch.ones(2)}, str(link), None) is None
    assert link.is_symlink()
    assert torch.equal(torch.load(tmp_path / "real" / "model.pt", weights_only=True)["w"], torch.ones(2))


# ------------------------------------------------------------------------------ under mpirun


def missing_dir(d: Path) -> Case:
    args = [*COMMON, "--model", "tests.test_outputs:watched_mlp",
            "--model-args", json.dumps({**MLP, "built": str(d / "built")}), "--steps", "2",
            "--save", str(d / "missing" / "model.pt")]
    return Case(2, args, check=False)


@batched(missing_dir)
def test_save_in_missing_directory_stops_before_the_model_is_built(mpi: MpiRun):
    built, save = mpi.dir / "built", mpi.dir / "missing" / "model.pt"
    proc = mpi.proc
    assert proc.returncode == 2, proc.stderr
    assert messages(proc.stderr) == {f"--save {save}: directory {save.parent} does not exist; create it first"}, \
        proc.stderr
    assert "Traceback" not in proc.stderr
    assert not built.exists(), "the model was built before the output paths were checked"


def hold_lock(ck: str, pid_file: str) -> None:
    """A case's `before`: another process locks `ck` (for at most 120 s) and its pid goes to `pid_file`. It
    holds none of the batch's output pipes (mpirun would wait for it) and outlives the batch: the test ends it."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pipeflow.outputs import CheckpointLock; "
                               "CheckpointLock(sys.argv[1]); print('locked', flush=True); time.sleep(120)", ck],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              start_new_session=True)
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    holder.stdout.close()
    Path(pid_file).write_text(str(holder.pid))


def second_training(d: Path) -> Case:
    ck = d / "ck"
    return Case(2, [*COMMON, "--steps", "2", "--checkpoint-dir", str(ck)], check=False,
                before=(f"{__name__}:hold_lock", [str(ck), str(d / "holder.pid")]))


@batched(second_training)
def test_second_training_on_a_checkpoint_dir_exits_2_naming_the_holder(mpi: MpiRun):
    ck = mpi.dir / "ck"
    pid = int((mpi.dir / "holder.pid").read_text())
    try:
        os.kill(pid, signal.SIGKILL)  # the holder hold_lock started for this test
    except ProcessLookupError:
        pass
    proc = mpi.proc
    assert proc.returncode == 2, proc.stderr
    want = re.compile(rf"--checkpoint-dir {ck} is in use by another training \(host {re.escape(socket.gethostname())}"
                      rf", pid {pid}, since [\d :-]+ UTC; lock file {ck}/pipeflow\.lock\): wait for it to end, "
                      r"or pass another --checkpoint-dir")
    msgs = messages(proc.stderr)
    assert msgs and all(want.search(m) for m in msgs), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(ck.glob("step-*")), "the second run wrote checkpoints"
    for _ in range(100):  # the holder's end released it
        try:
            CheckpointLock(str(ck)).release()
            break
        except OutputError:
            time.sleep(0.05)
    else:
        raise AssertionError(f"{ck} still locked after its holder was killed")


def check_lock_released(ck: str, report: str) -> None:
    """A case's `before`, in rank 0's process after an earlier case on `ck` returned: does this process
    still have the lock file open, and can another process lock it?"""
    open_fds = sum(os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(Path(ck) / "pipeflow.lock")
                   for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))
    other = subprocess.run([sys.executable, "-c", "import sys; from pipeflow.outputs import CheckpointLock; "
                            "CheckpointLock(sys.argv[1]).release()", ck], capture_output=True, text=True)
    Path(report).write_text(json.dumps({"open_fds": open_fds, "other_process": other.returncode,
                                        "stderr": other.stderr[-2000:]}))


def same_dir_twice(d: Path) -> list[Case]:
    ck = d / "ck"
    return [Case(2, [*COMMON, "--steps", "2", "--checkpoint-dir", str(ck)]),
            Case(2, [*COMMON, "--steps", "4", "--checkpoint-dir", str(ck), "--resume", "--save", str(d / "model.pt")],
                 before=(f"{__name__}:check_lock_released", [str(ck), str(d / "after-first.json")]))]


@batched(same_dir_twice)
def test_consecutive_runs_in_one_process_on_one_checkpoint_dir(mpi: MpiRun):
    """pipeflow.train.main releases the --checkpoint-dir lock when it returns (tests/mpi_batch.py calls it
    many times in one process): the lock file is closed, another process can lock the directory, and a
    second call on the same directory resumes and trains on."""
    after = json.loads((mpi.dir / "after-first.json").read_text())
    assert after["open_fds"] == 0, after
    assert after["other_process"] == 0, after
    assert [p.returncode for p in mpi.procs] == [0, 0]
    got = torch.load(mpi.dir / "model.pt", weights_only=True)
    want = reference_flush("mlp", MLP, steps=4, microbatches=2, microbatch_size=2, optimizer="adam", lr=0.01)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)
    assert (mpi.dir / "ck" / "step-000004" / "COMPLETE").is_file()


MOUNTED: list[Path] = []  # the batched runs' tmpfs mounts, unmounted at the session's end


@pytest.fixture(scope="session", autouse=True)
def _unmount_batched_tmpfs():
    """However its tests end (an error in the batch, a deselected test), no mount outlives the session. Not at
    the module's end: this module's in-process tests run before the batched ones (tests/conftest.py), and a
    module fixture ended with them, unmounting the tmpfs before the batch had written to it."""
    yield
    while MOUNTED:
        subprocess.run(["umount", "-l", str(MOUNTED.pop())], check=False, capture_output=True)


def tiny_mount(d: Path) -> Path:
    """A 64 KiB tmpfs at d/tiny (a disk that fills up), or a plain directory and d/no-tmpfs saying why."""
    tiny = d / "tiny"
    tiny.mkdir()
    why = "no mount command: the disk-full and read-only cases need a tmpfs"
    if shutil.which("mount") is not None:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)], capture_output=True,
                              text=True)
        if proc.returncode == 0:
            MOUNTED.append(tiny)
            # also at exit: a session ended before this module (-x, a deselection) never runs its fixture
            atexit.register(subprocess.run, ["umount", "-l", str(tiny)], check=False, capture_output=True)
            return tiny
        why = f"cannot mount a tmpfs (needs root with CAP_SYS_ADMIN): {proc.stderr.strip()}"
    (d / "no-tmpfs").write_text(why)
    return tiny


def tiny_of(mpi: MpiRun) -> Path:
    """The batched run's tmpfs, or skip if there is none."""
    if (mpi.dir / "no-tmpfs").exists():
        pytest.skip((mpi.dir / "no-tmpfs").read_text())
    return mpi.dir / "tiny"


def disk_full_checkpoint(d: Path) -> Case:
    tiny = tiny_mount(d)
    return Case(2, [*COMMON, "--steps", "4", "--checkpoint-dir", str(tiny), "--checkpoint-every", "2"], check=False)


@batched(disk_full_checkpoint)
def test_disk_full_while_checkpointing_is_one_line_and_the_step_stays_unmarked(mpi: MpiRun):
    tiny_fs = tiny_of(mpi)
    proc = mpi.proc
    assert proc.returncode == 2, proc.stderr
    msgs = messages(proc.stderr)
    assert len(msgs) == 1, proc.stderr
    assert re.fullmatch(rf"checkpoint of step 2 to {tiny_fs}/step-000002 failed: cannot write stage-00[01]\.pt: "
                        "No space left on device", msgs.pop()), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tiny_fs / "step-000002" / "COMPLETE").exists()
    assert not (tiny_fs / "step-000004").exists()


def failed_final_save(d: Path) -> Case:
    tiny = tiny_mount(d)
    return Case(2, [*COMMON, "--steps", "3", "--checkpoint-dir", str(d / "ck"), "--save", str(tiny / "model.pt")],
                check=False)


@batched(failed_final_save)
def test_failed_final_save_keeps_the_weights_next_to_the_checkpoints(mpi: MpiRun):
    tiny_fs = tiny_of(mpi)
    ck, save = mpi.dir / "ck", tiny_fs / "model.pt"
    proc = mpi.proc
    assert proc.returncode == 2, proc.stderr
    msgs = messages(proc.stderr)
    assert len(msgs) == 1, proc.stderr
    m = re.fullmatch(rf"--save {save} failed \(No space left on device\); the trained weights were written to "
                     rf"{ck}/(model-rescued-\d+\.pt) instead", msgs.pop())
    assert m, proc.stderr
    assert "Traceback" not in proc.stderr
    got = torch.load(ck / m.group(1), weights_only=True)
    want = reference_flush("mlp", MLP, steps=3, microbatches=2, microbatch_size=2, optimizer="adam", lr=0.01)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11)
    assert (ck / "step-000003" / "COMPLETE").is_file()
