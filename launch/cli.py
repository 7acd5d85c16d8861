"""`pipeflow-launch`: builds the mpirun command for a plan, then prints (--dry-run) or runs it.

    pipeflow-launch --plan plan.json [--hosts h1:4,h2:4] [--mpirun PATH] [--mpi auto|mpich|openmpi] \
        [--env NAME=VALUE ...] [--dry-run] -- <pipeflow-train args>

runs `mpirun -np <plan.workers> ... pipeflow-train --plan plan.json <pipeflow-train args>`.
Hidden option `--program 'CMD ARGS'` (tests, debugging) replaces `pipeflow-train` by CMD ARGS;
`--plan PATH` and the train args are still appended.
"""
from __future__ import annotations

import argparse
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from launch.command import FLAVOURS, Flavour, LaunchError, mpirun_command, rank_env, train_command
from launch.hosts import HostsError, parse_hosts
from partitioner.plan import Plan, PlanError

PROG = "pipeflow-launch"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        if "unrecognized arguments" in message:
            message += " (put pipeflow-train's arguments after --)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run pipeflow-train under mpirun with one process per worker of a plan.",
                usage=f"{PROG} --plan PLAN [options] -- <pipeflow-train args>")
    p.add_argument("--plan", required=True, help="plan.json from pipeflow-plan; -np is its workers")
    p.add_argument("--hosts", help="NAME[:SLOTS],... e.g. h1:4,h2:4; ranks fill hosts in order (default: this machine)")
    p.add_argument("--mpirun", help="mpirun to use (default: the one next to this Python, else on PATH)")
    p.add_argument("--mpi", default="auto", choices=("auto", *FLAVOURS),
                   help="MPI flavour (default: auto, from `mpirun --version`; one given must agree with it, but "
                        "under --dry-run)")
    p.add_argument("--env", action="extend", nargs="+", default=[], metavar="NAME=VALUE",
                   help="set on every rank (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("--program", help=argparse.SUPPRESS)
    return p


def find_mpirun(given: str | None) -> str:
    if given is not None:
        found = shutil.which(given)
        if found is None:
            raise LaunchError(f"--mpirun {given}: not found or not executable; expected a path to mpirun")
        return given if os.sep in given else found
    # The mpirun next to this interpreter matches the MPI mpi4py was installed with (pip install mpich).
    local = Path(sysconfig.get_path("scripts")) / "mpirun"
    if os.access(local, os.X_OK):
        return str(local)
    found = shutil.which("mpirun")
    if found is None:
        raise LaunchError(f"mpirun not found in {local.parent} or on PATH: install MPI (pip install mpich) "
                          "or pass --mpirun PATH")
    return found


def detect_flavour(mpirun: str) -> Flavour:
    """From `mpirun --version`: MPICH's Hydra says HYDRA/MPICH (Intel MPI is Hydra too), Open MPI says so."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"cannot run `{mpirun} --version` to tell the MPI flavour ({e}): "
                          "pass --mpi mpich or --mpi openmpi") from None
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return "mpich"
    first = text.strip().splitlines()[0] if text.strip() else ""
    raise LaunchError(f"cannot tell the MPI flavour of {mpirun}: expected 'HYDRA'/'MPICH' or 'Open MPI'/'OpenRTE' "
                      f"in `mpirun --version`, found {first!r}; pass --mpi mpich or --mpi openmpi")


def resolve_flavour(mpirun: str, given: str, *, launching: bool) -> Flavour:
    """--mpi: `auto` detects it; a flavour given is checked against the mpirun that will run the job (a dry run may
    print a command for another machine's MPI), and taken as given where `mpirun --version` cannot tell."""
    if given == "auto":
        return detect_flavour(mpirun)
    flavour: Flavour = "openmpi" if given == "openmpi" else "mpich"
    if launching:
        try:
            found = detect_flavour(mpirun)
        except LaunchError:
            return flavour
        if found != flavour:
            raise LaunchError(f"--mpi {given}, but `{mpirun} --version` says it is {found}: expected the flavour of "
                              f"the mpirun that runs the job; pass --mpi {found} (or auto), or point --mpirun at the "
                              f"{given} one")
    return flavour


def parse_env(items: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            raise LaunchError(f"--env {item!r}: expected NAME=VALUE with NAME a variable name")
        env[name] = value
    return env


def train_program() -> list[str]:
    """`pipeflow-train` next to this interpreter if installed, else this interpreter with -m pipeflow.train."""
    script = Path(sysconfig.get_path("scripts")) / "pipeflow-train"
    return [str(script)] if os.access(script, os.X_OK) else [sys.executable, "-m", "pipeflow.train"]


def build(args: argparse.Namespace, train_args: Sequence[str]) -> list[str]:
    plan = Plan.load(args.plan)
    hosts = parse_hosts(args.hosts) if args.hosts is not None else None
    env = parse_env(args.env)
    program = shlex.split(args.program) if args.program is not None else train_program()
    # Absolute, so ranks started elsewhere (other hosts, another -wdir) find the same file.
    train = train_command(program, os.path.abspath(args.plan), train_args)
    mpirun = find_mpirun(args.mpirun)
    flavour = resolve_flavour(mpirun, args.mpi, launching=not args.dry_run)
    return mpirun_command(mpirun=mpirun, flavour=flavour, workers=plan.workers, hosts=hosts,
                          env=rank_env(environ=os.environ, extra=env), program=train,
                          as_root=hasattr(os, "geteuid") and os.geteuid() == 0, cpu_count=os.cpu_count())


# Exit codes of pipeflow-train that come with its own message (train.py, failure.py): usage, traceback,
# dead peer, non-finite, SIGINT, SIGTERM. Any other code from mpirun means a rank died without a word.
TRAIN_CODES = (0, 1, 2, 3, 4, 128 + signal.SIGINT, 128 + signal.SIGTERM)


class RankWatch:
    """Which rank died first, from the pids the ranks write to $PIPEFLOW_PID_DIR (watchdog.write_pid_file).

    MPICH's mpirun kills every rank at once when one is killed (a kill -9, the OOM killer, a segfault),
    before any survivor can speak, and its banner names a pid. With auto-cleanup off the survivors are
    sent SIGUSR1 and die on their next MPI call to the dead rank, still silently (MPICH 5.0.2; issue 11).
    So the launcher, which outlives the job, watches the pids of the ranks on this host and names the
    first that vanished while mpirun still ran. It waits on a pidfd per rank (Linux >= 5.3), so the
    kernel wakes it at the first exit rather than at its next poll; when it wakes to several exits at
    once (a loaded machine), the rank already reaped by MPI's process manager died first: the manager
    reaps the dead rank before it kills the others, which are still zombies then.
    """

    def __init__(self, pid_dir: Path, workers: int) -> None:
        self.pid_dir, self.workers = pid_dir, workers
        self.pids: dict[int, int] = {}
        self.fds: dict[int, int] = {}  # rank -> pidfd
        self.first_dead: tuple[int, int] | None = None  # (rank, pid)

    def _discover(self) -> None:
        if len(self.pids) >= self.workers:
            return
        for f in self.pid_dir.glob("rank*.pid"):
            try:
                rank, pid = int(f.stem[4:]), int(f.read_text())
            except (ValueError, OSError):
                continue  # being written
            if rank in self.pids:
                continue
            self.pids[rank] = pid
            try:
                self.fds[rank] = os.pidfd_open(pid)
            except (OSError, AttributeError):
                pass  # gone already (found below by kill 0), or no pidfds: polling only

    def _gone(self, rank: int) -> bool:
        fd = self.fds.get(rank)
        if fd is not None:
            return bool(select.select([fd], [], [], 0)[0])
        try:
            os.kill(self.pids[rank], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    def poll(self) -> None:
        self._discover()
        if self.first_dead is not None:
            return
        gone = [r for r in sorted(self.pids) if self._gone(r)]
        if not gone:
            return
        # Several at once: prefer the one whose process entry is already reaped (no longer a zombie).
        reaped = [r for r in gone if not Path(f"/proc/{self.pids[r]}").exists()]
        rank = (reaped or gone)[0]
        self.first_dead = (rank, self.pids[rank])

    def wait(self, timeout: float) -> None:
        """Sleep until a watched rank exits or `timeout` seconds pass."""
        fds = list(self.fds.values())
        if fds:
            select.select(fds, [], [], timeout)
        else:
            time.sleep(min(timeout, 0.02))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def explain(self, rc: int) -> str | None:
        """The line to print after mpirun exited with `rc`, or None when pipeflow-train spoke itself."""
        if rc in TRAIN_CODES or self.first_dead is None:
            return None
        rank, pid = self.first_dead
        return (f"{PROG}: error: rank {rank} (pid {pid}) died first, without a message from pipeflow-train (killed by "
                f"a signal or crashed; mpirun exited {rc}), and mpirun ended the other ranks")


def run(argv: Sequence[str], watch: RankWatch | None = None) -> int:
    """Run argv, forwarding SIGINT/SIGTERM to it; its exit code (128+N if signal N killed it). With a
    watch, name the rank that died first when the job ends without pipeflow-train's own message."""
    try:
        proc = subprocess.Popen(list(argv))
    except OSError as e:
        print(f"{PROG}: error: cannot run {argv[0]}: {e.strerror}", file=sys.stderr)
        return 2

    def forward(signum: int, frame: FrameType | None) -> None:
        proc.send_signal(signum)  # mpirun passes it to the ranks and exits

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            if watch is None:
                rc = proc.wait()
                break
            watch.poll()
            if watch.first_dead is None:
                watch.wait(0.05 if len(watch.pids) == watch.workers else 0.02)
                watch.poll()
            try:  # once a rank is known dead, only mpirun's end is left to wait for
                rc = proc.wait(timeout=0.1 if watch.first_dead is not None else 0)
                break
            except subprocess.TimeoutExpired:
                pass
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if watch is not None:
            watch.close()
    rc = 128 - rc if rc < 0 else rc
    line = watch.explain(rc) if watch is not None else None
    if line is not None:
        os.write(2, f"{line}\n".encode())
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(own)
    try:
        cmd = build(args, train_args)
    except (PlanError, HostsError, LaunchError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    given = parse_env(args.env).get("PIPEFLOW_PID_DIR")
    with tempfile.TemporaryDirectory(prefix="pipeflow-launch-") as tmp:
        watch = None
        if args.hosts is None:  # every rank on this host: their pids can be watched (RankWatch)
            pid_dir = Path(given or tmp)
            if given is None:
                args.env.append(f"PIPEFLOW_PID_DIR={tmp}")
                cmd = build(args, train_args)
            watch = RankWatch(pid_dir, Plan.load(args.plan).workers)
        print(f"{PROG}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        return run(cmd, watch)


if __name__ == "__main__":
    sys.exit(main())
