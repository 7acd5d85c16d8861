"""pipeflow-launch: host parsing, the mpirun argv per MPI flavour, the CLI end to end, and a real 2-rank run."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.cli import main, train_program
from launch.command import PASSTHROUGH_ENV, LaunchError, mpirun_command, rank_env, train_command
from launch.hosts import Host, HostsError, check_slots, parse_hosts

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = Path(sys.executable).parent / "mpirun"  # MPICH from PyPI, next to the interpreter
needs_mpirun = pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun at {MPIRUN}")
TIMEOUT = 60
SYNTAX = "(expected NAME[:SLOTS],... e.g. h1:4,h2:4)"


def write_plan(path: Path, workers: int) -> Path:
    stages = [{"layers": [2 * r, 2 * r + 2], "replicas": 1, "ranks": [r]} for r in range(workers)]
    path.write_text(json.dumps({"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": 4,
                                "workers": workers, "stages": stages}))
    return path


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`pipeflow-launch args` as a process of its own: the console script end to end (the real runs below)."""
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture
def launch_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """launch(...)'s result from pipeflow-launch's main in this process, for the runs that start no mpirun."""
    def call(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        if env is not None:
            for k in list(os.environ):
                if k not in env:
                    monkeypatch.delenv(k)
            for k, v in env.items():
                monkeypatch.setenv(k, v)
        monkeypatch.chdir(ROOT)
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's errors
            code = e.code if isinstance(e.code, int) else 1
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["pipeflow-launch", *args], code, out.out, out.err)

    return call


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PASSTHROUGH_ENV}
    return {**env, **extra}


# --- hosts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, hosts", [
    ("h1:4,h2:4", [Host("h1", 4), Host("h2", 4)]),
    ("node-1.cluster,node_2:3", [Host("node-1.cluster", 1), Host("node_2", 3)]),
    (" h1:2 , h2 ", [Host("h1", 2), Host("h2", 1)]),
])
def test_parse_hosts(spec: str, hosts: list[Host]) -> None:
    assert parse_hosts(spec) == hosts


@pytest.mark.parametrize("spec, message", [
    ("h1:x", f"--hosts entry 'h1:x': slots must be a positive integer, found 'x' {SYNTAX}"),
    ("h1:0", f"--hosts entry 'h1:0': slots must be a positive integer, found '0' {SYNTAX}"),
    ("h1:4,h2:-1", f"--hosts entry 'h2:-1': slots must be a positive integer, found '-1' {SYNTAX}"),
    ("h1:", f"--hosts entry 'h1:': slots must be a positive integer, found '' {SYNTAX}"),
    (":4", f"--hosts entry ':4': empty host name {SYNTAX}"),
    ("h1,,h2", f"--hosts entry '': empty host name {SYNTAX}"),
    ("h 1:2", f"--hosts entry 'h 1:2': host name 'h 1' may only contain letters, digits, '.', '-' and '_' {SYNTAX}"),
    ("h1:2,h1:2", "--hosts lists 'h1' twice: give each host once, with its total slots"),
])
def test_parse_hosts_errors(spec: str, message: str) -> None:
    with pytest.raises(HostsError) as e:
        parse_hosts(spec)
    assert str(e.value) == message


def test_too_few_slots() -> None:
    message = "--hosts h1:2,h2:1 gives 3 slots but the plan needs 4 workers: add hosts or slots (NAME:SLOTS)"
    with pytest.raises(HostsError) as e:
        check_slots(parse_hosts("h1:2,h2:1"), 4)
    assert str(e.value) == message
    with pytest.raises(HostsError) as e:
        mpirun_command(mpirun="mpirun", flavour="mpich", workers=4, hosts=parse_hosts("h1:2,h2:1"), env={},
                       program=["prog"])
    assert str(e.value) == message
    check_slots(parse_hosts("h1:3,h2:3"), 4)  # more slots than workers is fine: the last host gets fewer


# --- command -------------------------------------------------------------------------------------

ENV = {"PYTHONUNBUFFERED": "1", "FOO": "a b"}
PROG = ["pipeflow-train", "--plan", "/p/plan.json", "--steps", "3"]


@pytest.mark.parametrize("flavour, hosts, as_root, cpus, expected", [
    ("mpich", None, True, 2,
     ["mpirun", "-np", "4", "-genv", "PYTHONUNBUFFERED", "1", "-genv", "FOO", "a b", *PROG]),
    ("mpich", "h1:2,h2:2", False, 2,
     ["mpirun", "-np", "4", "-hosts", "h1:2,h2:2", "-genv", "PYTHONUNBUFFERED", "1", "-genv", "FOO", "a b", *PROG]),
    ("openmpi", None, False, 8,
     ["mpirun", "-np", "4", "-x", "PYTHONUNBUFFERED=1", "-x", "FOO=a b", *PROG]),
    ("openmpi", None, True, 2,
     ["mpirun", "-np", "4", "--allow-run-as-root", "--oversubscribe", "-x", "PYTHONUNBUFFERED=1", "-x", "FOO=a b",
      *PROG]),
    ("openmpi", "h1:2,h2:2", True, 2,  # the slots say where ranks go: no --oversubscribe
     ["mpirun", "-np", "4", "--allow-run-as-root", "--host", "h1:2,h2:2", "-x", "PYTHONUNBUFFERED=1",
      "-x", "FOO=a b", *PROG]),
])
def test_mpirun_command(flavour: str, hosts: str | None, as_root: bool, cpus: int, expected: list[str]) -> None:
    argv = mpirun_command(mpirun="mpirun", flavour=flavour,  # type: ignore[arg-type]
                          workers=4, hosts=parse_hosts(hosts) if hosts else None, env=ENV, program=PROG,
                          as_root=as_root, cpu_count=cpus)
    assert argv == expected


def test_unknown_flavour() -> None:
    with pytest.raises(LaunchError, match="MPI flavour 'intel' is unknown, expected one of mpich, openmpi"):
        mpirun_command(mpirun="mpirun", flavour="intel", workers=1, hosts=None, env={},  # type: ignore[arg-type]
                       program=["p"])


def test_rank_env() -> None:
    environ = {"PYTHONPATH": "/src", "NCCL_NVLS_ENABLE": "0", "HOME": "/root", "MPI4PY_LIBMPI": "libmpi.so"}
    assert rank_env(environ=environ, extra={"X": "1", "PYTHONUNBUFFERED": "0"}) == {
        "PYTHONUNBUFFERED": "0", "NCCL_NVLS_ENABLE": "0", "MPI4PY_LIBMPI": "libmpi.so", "PYTHONPATH": "/src", "X": "1"}


@pytest.mark.parametrize("args", [["--plan", "x.json"], ["--steps", "2", "--plan=x.json"]])
def test_train_args_may_not_name_a_plan(args: list[str]) -> None:
    with pytest.raises(LaunchError, match="contain --plan, but pipeflow-launch passes --plan /p.json itself"):
        train_command(["pipeflow-train"], "/p.json", args)
    assert train_command(["t"], "/p.json", ["--planner", "x"]) == ["t", "--plan", "/p.json", "--planner", "x"]


# --- CLI end to end ------------------------------------------------------------------------------

@needs_mpirun
@pytest.mark.parametrize("mpi", ["mpich", "auto"])
def test_dry_run_mpich(launch_main, tmp_path: Path, mpi: str) -> None:
    plan = write_plan(tmp_path / "plan.json", 4)
    r = launch_main("--plan", str(plan), "--hosts", "h1:2,h2:2", "--mpirun", str(MPIRUN), "--mpi", mpi,
               "--env", "FOO=a b", "--dry-run", "--", "--steps", "3", "--model", "gpt",
               env=clean_env(NCCL_NVLS_ENABLE="0"))
    assert r.returncode == 0, r.stderr
    expected = [str(MPIRUN), "-np", "4", "-hosts", "h1:2,h2:2", "-genv", "PYTHONUNBUFFERED", "1",
                "-genv", "NCCL_NVLS_ENABLE", "0", "-genv", "FOO", "a b",
                *train_program(), "--plan", str(plan), "--steps", "3", "--model", "gpt"]
    assert r.stdout == shlex.join(expected) + "\n"


def test_dry_run_openmpi_detected(launch_main, tmp_path: Path) -> None:
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.5'\n")
    fake.chmod(0o755)
    plan = write_plan(tmp_path / "plan.json", 4)
    r = launch_main("--plan", str(plan), "--mpirun", str(fake), "--dry-run", "--", "--steps", "3", env=clean_env())
    assert r.returncode == 0, r.stderr
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    over = ["--oversubscribe"] if 4 > (os.cpu_count() or 1) else []
    expected = [str(fake), "-np", "4", *root, *over, "-x", "PYTHONUNBUFFERED=1",
                *train_program(), "--plan", str(plan), "--steps", "3"]
    assert r.stdout == shlex.join(expected) + "\n"


def test_a_flavour_given_that_the_mpirun_contradicts_is_refused_before_it_runs(launch_main, tmp_path: Path) -> None:
    """--mpi openmpi with MPICH's mpirun ran it with Open MPI's flags: four lines of Hydra's parse errors, exit 255.
    A dry run may print a command for another machine's MPI; a flavour `--version` cannot tell is taken as given."""
    ran = tmp_path / "ran"
    fake = tmp_path / "mpirun"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && echo 'HYDRA build details:' && exit 0\ntouch {ran}\n")
    fake.chmod(0o755)
    plan = write_plan(tmp_path / "plan.json", 2)
    r = launch_main("--plan", str(plan), "--mpirun", str(fake), "--mpi", "openmpi", "--", "--steps", "1")
    assert (r.returncode, r.stdout, ran.exists()) == (2, "", False)
    assert r.stderr == (f"pipeflow-launch: error: --mpi openmpi, but `{fake} --version` says it is mpich: expected the "
                        "flavour of the mpirun that runs the job; pass --mpi mpich (or auto), or point --mpirun at the "
                        "openmpi one\n")
    r = launch_main("--plan", str(plan), "--mpirun", str(fake), "--mpi", "openmpi", "--dry-run", "--", "--steps", "1")
    assert r.returncode == 0 and r.stdout.startswith(f"{fake} -np 2 "), r.stderr
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exit 0\ntouch {ran}\n")  # says nothing: --mpi decides
    r = launch_main("--plan", str(plan), "--mpirun", str(fake), "--mpi", "mpich", "--", "--steps", "1")
    assert r.returncode == 0 and ran.exists(), r.stderr


def test_missing_plan(launch_main, tmp_path: Path) -> None:
    r = launch_main("--plan", str(tmp_path / "nope.json"), "--dry-run")
    assert r.returncode == 2
    assert r.stderr == f"pipeflow-launch: error: cannot read plan {tmp_path / 'nope.json'}: No such file or directory\n"
    assert r.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["--hosts", "h1:x"], "--hosts entry 'h1:x': slots must be a positive integer, found 'x'"),
    (["--hosts", "h1:0"], "--hosts entry 'h1:0': slots must be a positive integer, found '0'"),
    (["--hosts", "h1:1"], "--hosts h1:1 gives 1 slot but the plan needs 2 workers"),
    (["--mpi", "intel"], "argument --mpi: invalid choice: 'intel'"),
    (["--mpirun", "/no/such/mpirun"], "--mpirun /no/such/mpirun: not found or not executable"),
    (["--env", "NOEQUALS"], "--env 'NOEQUALS': expected NAME=VALUE"),
    (["--steps", "3"], "unrecognized arguments: --steps 3 (put pipeflow-train's arguments after --)"),
    (["--", "--plan", "other.json"], "contain --plan, but pipeflow-launch passes --plan"),
    (["--mpirun", "/bin/true"], "cannot tell the MPI flavour of /bin/true: expected 'HYDRA'/'MPICH' or"),
])
def test_bad_input_exits_2(launch_main, tmp_path: Path, args: list[str], message: str) -> None:
    plan = write_plan(tmp_path / "plan.json", 2)
    r = launch_main("--plan", str(plan), "--dry-run", *args)
    assert r.returncode == 2
    assert r.stderr.startswith("pipeflow-launch: error: ") and message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_invalid_plan(launch_main, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "pipeflow.plan/0", "workers": 2}))
    r = launch_main("--plan", str(plan), "--dry-run")
    assert r.returncode == 2
    assert r.stderr == f"pipeflow-launch: error: {plan}: format is 'pipeflow.plan/0', expected 'pipeflow.plan/1'\n"


# --- real runs under mpirun ----------------------------------------------------------------------

# One write per line: print() writes the text and the newline separately, and mpirun may interleave ranks between.
SIZE = "import sys; from mpi4py import MPI; sys.stdout.write(f'{MPI.COMM_WORLD.Get_size()}\\n')"


@needs_mpirun
def test_run_two_ranks(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", 2)
    program = shlex.join([sys.executable, "-c", SIZE])
    r = launch("--plan", str(plan), "--mpirun", str(MPIRUN), "--program", program, "--", "--steps", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "2"]
    assert r.stderr.startswith(f"pipeflow-launch: {MPIRUN} -np 2 ")


@needs_mpirun
def test_run_propagates_exit_code(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", 2)
    program = shlex.join([sys.executable, "-c", "import sys; sys.exit(3)"])
    r = launch("--plan", str(plan), "--mpirun", str(MPIRUN), "--program", program)
    assert r.returncode == 3, r.stderr


@needs_mpirun
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_forwards_signals(tmp_path: Path, sig: signal.Signals) -> None:
    plan = write_plan(tmp_path / "plan.json", 2)
    program = shlex.join([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"])
    p = subprocess.Popen([sys.executable, "-m", "launch.cli", "--plan", str(plan), "--mpirun", str(MPIRUN),
                          "--program", program], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        seen = ""
        assert p.stdout is not None
        while seen.count("up") < 2:  # both ranks are running
            line = p.stdout.readline()
            assert line, "launcher ended before both ranks started"
            seen += line
        start = time.monotonic()
        p.send_signal(sig)
        rc = p.wait(timeout=TIMEOUT)
        assert rc != 0 and time.monotonic() - start < 30
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
