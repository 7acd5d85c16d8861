"""Output paths: checked before training starts, the --checkpoint-dir lock, and a final save that cannot lose
the trained weights.

Every path a run writes (--save, --trace, --tensorboard, --checkpoint-dir) is tried at set-up by creating and
removing a file where it will be written, so a read-only filesystem, /proc or a missing directory is one line
and exit 2 before the model is built, not a traceback after hours of training.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.jsonfile import load_json
from partitioner.outputs import same_file

if TYPE_CHECKING:
    from pipeflow.config import TrainConfig

log = logging.getLogger(__name__)

LOCK_NAME = "pipeflow.lock"  # in --checkpoint-dir; rank 0 holds an fcntl lock on it for the whole run


class OutputError(ValueError):
    """An output path that cannot be written; a set-up error (exit 2)."""


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe(d: Path) -> str | None:
    """Why no file can be created in directory `d` (strerror), or None when one can. Trying is the only exact
    test: os.access says yes to root on a read-only bind mount's directories, and /proc refuses creation."""
    probe = d / f".pipeflow-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    try:
        probe.unlink()
    except OSError as e:
        return e.strerror or str(e)
    return None


def _through_link(path: str) -> Path:
    """Where writing `path` lands: a symlink is written through (as torch.save(path) does), not replaced."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)


def check_file(flag: str, path: str) -> None:
    """A file written at the end (--save, --trace): its directory exists and takes new files."""
    if not path:  # Path("") is the working directory
        raise OutputError(f"{flag} must be a file path, found ''")
    p = _through_link(path)
    if p.is_dir():
        example = "trace.json" if flag == "--trace" else "model.pt"
        raise OutputError(f"{flag} {path}: is a directory; expected a file name in it (e.g. {p / example})")
    parent = p.parent
    if not parent.is_dir():
        near = _nearest_existing(parent)
        if near.exists() and not near.is_dir():
            raise OutputError(f"{flag} {path}: {near} is a file, not a directory")
        raise OutputError(f"{flag} {path}: directory {parent} does not exist; create it first")
    why = _probe(parent)
    if why:
        raise OutputError(f"{flag} {path}: cannot create files in {parent}: {why}")


def check_dir(flag: str, path: str) -> None:
    """A directory written during the run (--tensorboard, --checkpoint-dir), created if missing: it, or the
    nearest directory above it that exists, takes new files."""
    if not path:
        raise OutputError(f"{flag} must be a directory path, found ''")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{flag} {path}: is a file; expected a directory")
    near = _nearest_existing(p)
    if not near.is_dir():
        raise OutputError(f"{flag} {path}: {near} is a file, not a directory")
    why = _probe(near)
    if why:
        raise OutputError(f"{flag} {path}: cannot create files in {near}: {why}")


def check_outputs(args: TrainConfig) -> None:
    """Every output path of a pipeflow-train run; raises OutputError naming the flag, the path and the reason."""
    for flag, path in (("--save", args.save), ("--trace", args.trace)):
        if path is not None:
            check_file(flag, path)
    for flag, path in (("--tensorboard", args.tensorboard), ("--checkpoint-dir", args.checkpoint_dir)):
        if path is not None:
            check_dir(flag, path)


def _among_checkpoints(path: str, checkpoint_dir: str) -> bool:
    """Whether `path` is one that writing checkpoints to `checkpoint_dir` replaces: a step directory, or in one,
    or the lock file."""
    from pipeflow.checkpoint import _STEP_RE

    inside = Path(os.path.realpath(path))
    root = Path(os.path.realpath(checkpoint_dir))
    if not inside.is_relative_to(root) or inside == root:
        return False
    first = inside.relative_to(root).parts[0]
    return first == LOCK_NAME or _STEP_RE.match(first) is not None


def check_clashes(args: TrainConfig) -> None:
    """No output overwrites another output or an input (check_outputs takes each path alone): two outputs on one
    path, an output on the --plan or --resume path, a file where the checkpoints go; an empty input path."""
    for flag, path, what in (("--plan", args.plan, "a plan.json path"),
                             ("--resume", args.resume, "a checkpoint path (no value: the newest in --checkpoint-dir)")):
        if path == "":
            raise OutputError(f"{flag} must be {what}, found ''")
    outputs = [(flag, path) for flag, path in (("--save", args.save), ("--trace", args.trace),
                                               ("--tensorboard", args.tensorboard),
                                               ("--checkpoint-dir", args.checkpoint_dir)) if path]
    inputs = [(flag, path) for flag, path in (("--plan", args.plan), ("--resume", args.resume))
              if path and path != "latest"]
    for k, (flag, path) in enumerate(outputs):
        for other, there in outputs[:k]:
            if same_file(path, there):
                raise OutputError(f"{flag} {path}: is also {other}'s path, so one output would overwrite the other; "
                                  "give each output its own path")
        for other, there in inputs:
            if same_file(path, there) and (flag, other) != ("--checkpoint-dir", "--resume"):  # resuming where it left
                raise OutputError(f"{flag} {path}: is also {other}'s path, an input of this run, which writing {flag} "
                                  f"would overwrite; give {flag} another path")
        if flag in ("--save", "--trace") and args.checkpoint_dir and _among_checkpoints(path, args.checkpoint_dir):
            raise OutputError(f"{flag} {path}: is where --checkpoint-dir {args.checkpoint_dir} writes its checkpoints "
                              f"(step-NNNNNN/, {LOCK_NAME}), which would overwrite it; give {flag} another path")


def check_new_run(args: TrainConfig) -> None:
    """A run started without --resume in a --checkpoint-dir holding complete checkpoints would write its step
    directories over the earlier run's, and a later --resume would load a mix of the two models."""
    from pipeflow.restore import complete_steps

    found = complete_steps(args.checkpoint_dir) if args.checkpoint_dir and args.resume is None else []
    if found:
        raise OutputError(f"--checkpoint-dir {args.checkpoint_dir} holds the checkpoints of an earlier run (the newest "
                          f"complete one: {found[-1][1]}), which this run would overwrite; pass --resume to continue "
                          "it, or choose another --checkpoint-dir")


class CheckpointLock:
    """An exclusive fcntl lock on DIR/pipeflow.lock, holding the holder's host and pid: two trainings that
    write the same step directories would overwrite each other's checkpoints. The kernel drops the lock when
    the process ends, however it ends, so a lock file left behind never blocks anyone."""

    def __init__(self, directory: str) -> None:
        d = Path(directory)
        try:
            d.mkdir(parents=True, exist_ok=True)
            self.path = d / LOCK_NAME
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"--checkpoint-dir {directory}: cannot create {LOCK_NAME} in it: {e.strerror}") from None
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):  # e.g. ENOLCK: an NFS mount without lock daemon
                log.warning("--checkpoint-dir %s: cannot lock %s (%s); a second training on this directory would "
                            "not be refused", directory, self.path, e.strerror)
                return
            os.close(self.fd)
            raise OutputError(f"--checkpoint-dir {directory} is in use by another training ({holder(self.path)}; "
                              f"lock file {self.path}): wait for it to end, or pass another --checkpoint-dir") from None
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(self.fd)

    def release(self) -> None:
        os.close(self.fd)  # closing the descriptor drops the fcntl lock


# The lock this process holds for the running pipeflow.train.main call: released when it returns, so that
# calls one after the other in one process (tests/mpi_batch.py) neither keep the directory locked nor leak
# a file descriptor each.
_held: CheckpointLock | None = None


def release_checkpoint_lock() -> None:
    """Release the --checkpoint-dir lock prepare_outputs took, if any (pipeflow.train.main's end)."""
    global _held
    if _held is not None:
        lock, _held = _held, None
        lock.release()


def holder(path: Path) -> str:
    """'host H, pid P, since T' from a lock file; the holder may be between locking and writing: wait a moment."""
    for _ in range(20):
        try:
            info = load_json(path)
            return f"host {info['host']}, pid {info['pid']}, since {info['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.1)
    return "holder unknown: the lock file does not say"


def prepare_outputs(args: TrainConfig, rank: int) -> CheckpointLock | None:
    """Set-up: check every output path; rank 0 locks --checkpoint-dir (kept until release_checkpoint_lock,
    which pipeflow.train.main calls when it returns, or the process ends), then checks that a run started without
    --resume finds no checkpoint there (rank 0 writes the COMPLETE markers; a training still writing them is named
    by the lock instead)."""
    global _held
    check_outputs(args)
    check_clashes(args)
    release_checkpoint_lock()  # one lock per process: a call that did not return normally left its lock
    if args.checkpoint_dir and rank == 0:
        _held = CheckpointLock(args.checkpoint_dir)
        check_new_run(args)
        return _held
    return None


def write_model(state: dict[str, Any], path: str, checkpoint_dir: str | None) -> str | None:
    """torch.save `state` to `path` atomically; if that fails (the directory vanished, the disk filled), write
    it next to the checkpoints, else in the working directory, else in the temporary directory. Returns None,
    or the one line that says what failed and where the weights are."""
    from pipeflow.checkpoint import reason, write_torch

    try:
        write_torch(_through_link(path), state)
        log.info("saved %d tensors to %s", len(state), path)
        return None
    except (OSError, RuntimeError) as e:
        why = reason(e)
    p = Path(path)
    name = f"{p.stem}-rescued-{os.getpid()}{p.suffix or '.pt'}"  # never overwrites a file of the user's
    places = [Path(checkpoint_dir)] if checkpoint_dir else []
    places += [Path.cwd(), Path(tempfile.gettempdir())]
    tried = []
    for place in places:
        target = place / name
        try:
            write_torch(target, state)
        except (OSError, RuntimeError) as e:
            tried.append(f"{target}: {reason(e)}")
            continue
        return f"--save {path} failed ({why}); the trained weights were written to {target} instead"
    return f"--save {path} failed ({why}) and so did every fallback ({'; '.join(tried)}): the trained weights are lost"

