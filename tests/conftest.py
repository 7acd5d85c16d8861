"""Shared helpers: distributed test cases batched into one `mpirun` per -np, `run_mpi` for a run of its
own, and `write_plan`.

Batched distributed tests
-------------------------
Starting `mpirun -np N python -m pipeflow.train` costs ~11 s (python, torch, mpi4py, and ~3.5 s of
torch._dynamo, which torch.optim imports with the first optimizer) for well under a second of training
in a test. So a distributed test declares its run as a *case* and asserts on the case's outputs; the
cases of all selected tests (`-k` selects fewer) go to one `mpirun -np N python -m tests.mpi_batch
cases.json` per -np, which runs them one after the other in the same processes (tests/mpi_batch.py;
mpi4py's own suite runs one file under N processes the same way). The batches run in two background threads
(lanes, each one mpirun at a time; a group of many cases is split over both) from the first test on, while the
other tests run; the batched tests come last and read their outputs. One mpirun's ranks wait on each other
often, so two of them beside the in-process tests fill the cores that one left idle. On the 2-core machine, the
two ways alternated (2026-11-28, 1,504 tests): 110.2 and 107.8 s with two lanes, 112.6 and 111.2 s with one. The
batches now end at about 80 s, well before the in-process tests (about 100 s), which set the suite's time.
To write one:

    def case(d: Path, schedule: str) -> Case:           # d: the case's own directory
        return Case(2, ["--model", "mlp", "--schedule", schedule, "--save", str(d / "model.pt")])

    @pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
    @batched(case)                                       # the marker mpi(case)
    def test_something(mpi: MpiRun, schedule: str) -> None:
        got = torch.load(mpi.dir / "model.pt")          # mpi.proc: its CompletedProcess (stderr, returncode)

Moving a test onto it: the `run_mpi(np, args, env=..., timeout=...)` of its body becomes a builder
returning `Case(np, args, env=..., timeout=...)`, with paths under the builder's `d` instead of `tmp_path`;
the test takes `mpi` and reads its files from `mpi.dir` and the output from `mpi.proc.stderr`.

- The builder gets the directory and those of the test's parameters that its signature names; it runs
  when the first test is set up (for every selected batched test at once), so it may write input files
  (plans) into the directory.
- It may return a list of cases: they run in that order (later ones may read what earlier ones wrote,
  e.g. a checkpoint to resume; -np may differ between them), and `mpi.procs` holds one result each.
- Tests batched with the same builder and parameters share one run (a module's common run).
- `mpi.proc.stdout` / `.stderr` are the ranks' outputs of that case, one rank after the other (not
  interleaved as mpirun prints them); `.returncode` is the first non-zero rank exit code, or 0.
- By default a non-zero exit fails the test with the run's output; `Case(check=False)` for a run that
  returns non-zero on purpose (then assert on `mpi.proc.returncode`).
- A run that fails where pipeflow.train.main *returns* its code (a set-up error: exit 2; a stop every
  rank agrees on, such as a non-finite step of a flush schedule: exit 4) is batched with check=False.
  Runs with signals, dead or stopped ranks, an MPI Abort (asynchronous NaN, a rank's own error) and
  tests of the console scripts stay launches of their own (`run_mpi`, or Popen for signals): an Abort
  would end the whole batch.
- `PIPEFLOW_TEST_NO_BATCH=1` runs every case as its own `mpirun -np N python -m pipeflow.train`, for
  debugging one; a case that hangs or crashes in a batch is reported with its output, and the cases
  after it run in a new batch.
- `Case(before=("module:function", [args]))` runs that function once (rank 0) before the case: e.g. to
  copy and damage what an earlier case of the list wrote.
- Every launch has a timeout: `Case.timeout` per case (the batch driver dumps the stacks and ends the
  job when a case runs past it), their sum plus start-up for the batch's mpirun.

Launches of their own in the background
---------------------------------------
A test whose body only starts processes (an mpirun it signals, a console script) and asserts on what they
did spends its time waiting on them, one core idle. `@in_background` (the marker `background`) runs its
body in a second background thread from the session's start, one such test after the other in collection
order, while the in-process tests and the batches run (a batch lane with no batch left takes bodies too); the
test itself comes after the in-process tests
and reports the body's outcome (its assertion and traceback as they were). The foreground, arriving there,
runs the bodies not started yet itself, the last first, while the thread finishes its own (`Background.outcome`).
Its checks, timeouts and timings are the body's own, unchanged. The body may take only `tmp_path` (a directory
made for it) and its parameters; its processes get `base_env()` (os.environ as at the session's start: a
foreground test's monkeypatch.setenv must not reach them) and must not print into pytest's output. A test that is
skipped ignores its background run. `PIPEFLOW_TEST_NO_BATCH=1` runs them in the foreground too.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
MPIRUN = os.environ.get("PIPEFLOW_MPIRUN") or shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
BATCHES = pytest.StashKey["Batches"]()
LANES = 2  # batches run at once: one mpirun's ranks wait on each other, the other's fill the cores meanwhile
SPLIT_CASES = 60  # a group of at least this many cases is split over the lanes
BATCH_STARTUP_S = 120.0  # what a batch's mpirun may take beyond its cases' timeouts (start-up, loaded machine)


# The suite starts ~40 Python processes (mpirun ranks, console scripts, companions); each imports pipeflow and
# partitioner. Under PYTHONDONTWRITEBYTECODE (set on the 2-core machines) every one of them compiled those sources
# again (~0.3 s of CPU each); they write and share __pycache__ (git-ignored) instead. Alternating runs on one
# machine: 128 and 133 s against 156 and 144.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
_ENV_AT_START = dict(os.environ)  # before any test (conftest is imported first)
_IN_BACKGROUND = threading.local()


def base_env() -> dict[str, str]:
    """os.environ for a test's processes: as it is now, or in a test run in the background (`in_background`),
    as it was at the session's start, not as a foreground test's monkeypatch leaves it meanwhile. The repository
    leads PYTHONPATH: a process started from the background while a foreground test has changed directory
    (monkeypatch.chdir) found no module `tests` (`python -m tests.api_failing_layer`, once in four suite runs)."""
    env = dict(_ENV_AT_START if getattr(_IN_BACKGROUND, "on", False) else os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def mpi_env() -> dict[str, str]:
    env = base_env()
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PIPEFLOW_LOG="WARNING")
    # MPICH waits for a message by polling, and the ranks (THREAD_MULTIPLE: the heartbeat thread) call
    # sched_yield between polls: with more ranks than the 2 cores of a small machine that spinning took half
    # the CPU (perf: sys time). Heavy yield sleeps (nanosleep) instead, so the rank with work gets the core.
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    return env


BACKGROUND_NICE = 5  # the background threads' processes run at this niceness (`_behind_the_foreground`)


def _behind_the_foreground() -> None:
    """Lower the calling background thread's priority, and so that of every process it starts (Linux keeps a
    niceness per thread; a child inherits its thread's). The main thread's in-process tests are one core's
    work: the background's processes fill the other core and the foreground's gaps, instead of taking turns
    with it on both and leaving the in-process tests to run last on one core while the other idles. It
    changes no outcome: the runs are the same, they get the CPU a little later."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except OSError:
            pass


def _mpirun() -> str:
    if MPIRUN is None:
        pytest.fail("mpirun not found: install the package (it depends on mpich) or set PIPEFLOW_MPIRUN")
    return MPIRUN


def run_mpi(np: int, args: list[str], *, timeout: float = 180, module: str = "pipeflow.train",
            check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`mpirun -np N python -m module args`, a launch of its own; a hang fails the test through the timeout."""
    cmd = [_mpirun(), "-np", str(np), sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**mpi_env(), **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
                             f"stderr:\n{proc.stderr}")
    return proc


def write_plan(path: Path, schedule: str, m: int, stages: list[tuple[int, int]]) -> int:
    """A plan.json of consecutive (layer count, replicas) stages with ranks in order; returns the workers."""
    ranks, out, start = 0, [], 0
    for layers, reps in stages:
        out.append({"layers": [start, start + layers], "replicas": reps, "ranks": list(range(ranks, ranks + reps))})
        start += layers
        ranks += reps
    path.write_text(json.dumps({"format": "pipeflow.plan/1", "schedule": schedule, "microbatches": m,
                                "workers": ranks, "stages": out}))
    return ranks


# ------------------------------------------------------------------------------ batched cases


@dataclass
class Case:
    """One `pipeflow-train` run: `mpirun -np np pipeflow-train args`, with `env` added."""

    np: int
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 120.0
    check: bool = True
    # "module:function" and its JSON arguments, called once (rank 0) before the case runs: files a case
    # needs that an earlier case of the list writes (a copy of a checkpoint to damage, say).
    before: tuple[str, list[Any]] | None = None
    # What the ranks run: "module:function" called with `args` (returning the exit code); the module run
    # as a script (`python -m module args`) when not batched. Default: pipeflow-train itself.
    main: str = "pipeflow.train:main"


def call_before(before: tuple[str, list[Any]] | list[Any] | None) -> None:
    """Run a case's `before` hook in this process."""
    if before:
        import importlib

        module, _, name = before[0].partition(":")
        getattr(importlib.import_module(module), name)(*before[1])


@dataclass
class MpiRun:
    """What a test batched with `build` gets: its directory and one result per case (ranks' output joined
    in rank order, the first non-zero rank exit code, as mpirun reports them)."""

    dir: Path
    procs: list[subprocess.CompletedProcess[str]]
    seconds: list[float] = field(default_factory=list)  # each case's time in pipeflow.train.main (slowest rank)

    @property
    def proc(self) -> subprocess.CompletedProcess[str]:
        return self.procs[-1]


Builder = Callable[..., "Case | list[Case]"]


@dataclass
class _Step:
    key: str
    index: int
    case: Case
    out: Path
    proc: subprocess.CompletedProcess[str] | None = None
    seconds: float = float("nan")


def batched(build: Builder) -> pytest.MarkDecorator:
    """`@batched(build)`: the test's run is `build(directory, **its parameters)`, batched (module docstring)."""
    return pytest.mark.mpi.with_args(build)


def in_background(test: Callable[..., None]) -> Callable[..., None]:
    """`@in_background`: the test's body runs in the background thread (module docstring)."""
    return pytest.mark.background(test)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpi(build): a distributed test whose run is batched (tests/conftest.py)")
    config.addinivalue_line("markers", "background: a test of launches of its own whose body runs in a background "
                                       "thread (tests/conftest.py)")


def _builder(item: pytest.Item) -> Builder | None:
    marker = item.get_closest_marker("mpi")
    return marker.args[0] if marker is not None else None


def _params(item: pytest.Item, build: Builder) -> dict[str, Any]:
    names = list(inspect.signature(build).parameters)[1:]
    callspec = getattr(item, "callspec", None)
    given = callspec.params if callspec is not None else {}
    missing = [n for n in names if n not in given]
    if missing:
        raise pytest.UsageError(f"{item.nodeid}: the mpi builder {build.__qualname__} needs {missing}, which the "
                                "test is not parametrized with")
    return {n: given[n] for n in names}


def _key(build: Builder, params: dict[str, Any]) -> str:
    return f"{build.__module__}.{build.__qualname__}[{','.join(f'{k}={v!r}' for k, v in sorted(params.items()))}]"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Batched tests go last (in their order), so that the other tests run while the batches do (`Batches`
    starts them in the background before the first test). pytest-timeout covers fixtures too: the first
    test of a batch waits for the whole batch."""
    for item in items:
        if (_builder(item) is not None or _background(item)) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(1800))
    items[:] = ([i for i in items if _builder(i) is None and not _background(i)]
                + [i for i in items if _background(i)] + [i for i in items if _builder(i) is not None])


def _background(item: pytest.Item) -> bool:
    return item.get_closest_marker("background") is not None


class Batches:
    """The selected tests' cases, grouped by -np: `start()` runs the groups on LANES background threads while the
    other tests run (their mpiruns sleep while they wait, so they share the cores), a group only after those some
    test's cases need before it; `result` waits for the groups a test's cases need. With PIPEFLOW_TEST_NO_BATCH=1
    (one launch per case, for debugging) they run on demand instead."""

    def __init__(self, items: list[pytest.Item], root: Path, config: pytest.Config | None = None) -> None:
        self.root, self.config = root, config
        self.env = mpi_env()  # now, before any test changes os.environ (the thread reads no later one)
        self.dirs: dict[str, Path] = {}
        self.steps: dict[str, list[_Step]] = {}
        for item in items:
            build = _builder(item)
            if build is None:
                continue
            params = _params(item, build)
            key = _key(build, params)
            if key in self.steps:
                continue
            d = root / re.sub(r"[^A-Za-z0-9_.=-]+", "_", key)[-120:]
            d.mkdir(parents=True)
            made = build(d, **params)
            cases = made if isinstance(made, list) else [made]
            self.dirs[key] = d
            self.steps[key] = [_Step(key, i, c, d / ".mpi" / f"case{i}") for i, c in enumerate(cases)]
        self.after: dict[int, set[int]] = {}  # -np group -> the groups it must come after
        self.order = self._group_order()
        self.units = self._units()  # (-np, tests' keys): one mpirun each, longest groups first
        self.left = {n: sum(u[0] == n for u in self.units) for n in self.order}  # units of a group not ended
        self.done: set[int] = set()
        self.launches: list[tuple[int, int, float]] = []  # (-np, cases, seconds) of each mpirun
        self.finished = {n: threading.Event() for n in self.order}
        self.error: BaseException | None = None
        self.threads: list[threading.Thread] = []
        self.lock = threading.Condition()
        self.stopping = False
        self.running: set[subprocess.Popen[str]] = set()  # the lanes' mpiruns

    def start(self) -> None:
        """Run every group in the background (on LANES lanes), unless one launch per case was asked for."""
        if self.steps and os.environ.get("PIPEFLOW_TEST_NO_BATCH") != "1":
            self.threads = [threading.Thread(target=self._lane, name=f"mpi-batches-{i}", daemon=True)
                            for i in range(LANES)]
            for thread in self.threads:
                thread.start()

    def stop(self) -> None:
        """At the session's end (after -x, Ctrl-C or a deselected remainder): end what still runs."""
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        background = self._bodies()
        if background is not None:  # a lane running the background bodies takes no more of them
            background.stopping = True
        for proc in list(self.running):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for thread in self.threads:
            thread.join()

    def _lane(self) -> None:
        """Take the next unit whose group may start (every group it comes after finished), run it, until none is
        left; the last unit of a group to end marks the group finished."""
        _behind_the_foreground()
        try:
            while not self.stopping and (unit := self._next_unit()) is not None:
                n, keys = unit
                self._run_keys(n, keys)
                with self.lock:
                    self.left[n] -= 1
                    if not self.left[n]:
                        self.finished[n].set()
                    self.lock.notify_all()
            background = self._bodies()
            if background is not None and not self.stopping:  # no unit left: the background tests' bodies
                background.run_all()
        except BaseException as e:  # reported by every test that waits for it
            self.error = e
        finally:
            with self.lock:
                if self.error is not None or self.stopping:  # nothing more runs: no test waits forever
                    self.stopping = True
                    for event in self.finished.values():
                        event.set()
                self.lock.notify_all()

    def _bodies(self) -> Background | None:
        """The session's background tests (`in_background`), which a lane with no unit left runs too."""
        return self.config.stash.get(BACKGROUND, None) if self.config is not None else None

    def _next_unit(self) -> tuple[int, list[str]] | None:
        with self.lock:
            while self.units and not self.stopping:
                ready = [u for u in self.units if all(self.finished[a].is_set() for a in self.after.get(u[0], ()))]
                if ready:
                    self.units.remove(ready[0])
                    self.done.add(ready[0][0])
                    return ready[0]
                self.lock.wait()
            return None

    def _group_order(self) -> list[int]:
        """The -np groups in an order that runs each test's cases in theirs (first seen first)."""
        seen: list[int] = []
        after: dict[int, set[int]] = {}
        for steps in self.steps.values():
            for a, b in zip(steps, steps[1:]):
                if a.case.np != b.case.np:
                    after.setdefault(b.case.np, set()).add(a.case.np)
            for s in steps:
                if s.case.np not in seen:
                    seen.append(s.case.np)
        self.after = after
        order: list[int] = []
        while len(order) < len(seen):
            ready = [n for n in seen if n not in order and after.get(n, set()) <= set(order)]
            if not ready:
                raise pytest.UsageError(f"mpi cases need the -np groups in a cycle: {after}; split a test's cases")
            order.append(ready[0])
        return order

    def _units(self) -> list[tuple[int, list[str]]]:
        """Each group's tests (keys, in collection order) as one unit, or in LANES units of about equal case counts
        where the group holds at least SPLIT_CASES cases (a test's cases stay in one unit, in order); the groups of
        the most rank-cases (cases times ranks) first, so that the lanes end together."""
        units = []
        for n in self.order:
            keys = [k for k, steps in self.steps.items() if any(s.case.np == n for s in steps)]
            count = {k: sum(s.case.np == n for s in self.steps[k]) for k in keys}
            total = sum(count.values())
            parts = LANES if total >= SPLIT_CASES else 1
            split: list[list[str]] = [[] for _ in range(parts)]
            done = 0
            for k in keys:
                split[min(parts - 1, done * parts // total)].append(k)
                done += count[k]
            units += [(n, part) for part in split if part]
        cases = {n: sum(s.case.np == n for steps in self.steps.values() for s in steps) for n in self.order}
        return sorted(units, key=lambda u: -cases[u[0]] * u[0])

    def result(self, key: str) -> MpiRun:
        needed = {s.case.np for s in self.steps[key]}
        if self.threads:
            for n in needed:
                self.finished[n].wait()
            if self.error is not None:
                raise AssertionError(f"the batched cases did not run: {self.error!r}") from self.error
        for n in self.order:
            if not needed - self.done:
                break
            if n not in self.done:
                self.done.add(n)
                self._run_group(n)
        steps = self.steps[key]
        assert all(s.proc is not None for s in steps)
        return MpiRun(self.dirs[key], [s.proc for s in steps if s.proc is not None], [s.seconds for s in steps])

    def _run_group(self, n: int) -> None:
        self._run_keys(n, list(self.steps))

    def _run_keys(self, n: int, keys: list[str]) -> None:
        todo = [s for k in keys for s in self.steps[k] if s.case.np == n]
        # Within a test, its cases in order; tests in collection order.
        if os.environ.get("PIPEFLOW_TEST_NO_BATCH") == "1":
            for s in todo:
                call_before(s.case.before)
                t0 = time.monotonic()
                s.proc = run_mpi(n, s.case.args, timeout=s.case.timeout, check=False, env=s.case.env,
                                 module=s.case.main.partition(":")[0])
                s.seconds = time.monotonic() - t0
                self.launches.append((n, 1, s.seconds))
            return
        attempt = 0
        while todo and not self.stopping:
            attempt += 1
            todo = self._launch(n, todo, self.root / f"np{n}-batch{attempt}.json")

    def _launch(self, n: int, todo: list[_Step], path: Path) -> list[_Step]:
        """One mpirun for `todo`; returns the cases after the first that did not finish (to run again)."""
        path = path.with_name(f"{path.stem}-{re.sub(r'[^A-Za-z0-9_.=-]+', '_', todo[0].key)[-60:]}.json")
        path.write_text(json.dumps([{"id": s.key, "args": s.case.args, "env": s.case.env, "timeout": s.case.timeout,
                                     "out": str(s.out), "before": s.case.before, "main": s.case.main}
                                    for s in todo], indent=1))
        cmd = [_mpirun(), "-np", str(n), sys.executable, "-m", "tests.mpi_batch", str(path)]
        limit = BATCH_STARTUP_S + sum(s.case.timeout for s in todo)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
                                cwd=ROOT, start_new_session=True)
        self.running.add(proc)
        try:
            out, err = proc.communicate(timeout=limit)
            why = f"the batch exited {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # mpirun and the ranks it started
            out, err = proc.communicate()
            why = f"the batch ran past its timeout of {limit:.0f} s"
        self.running.discard(proc)
        self.launches.append((n, len(todo), time.monotonic() - t0))
        for i, s in enumerate(todo):
            codes = [_read_code(s.out / f"rank{r}.json") for r in range(n)]
            if all(c is not None for c in codes):
                s.proc = _completed(s, codes)
                s.seconds = max(_read_seconds(s.out / f"rank{r}.json") for r in range(n))
                continue
            tail = (f"\n--- {' '.join(cmd)}: {why} before this case finished\n"
                    f"stdout:\n{out[-5000:]}\nstderr:\n{err[-5000:]}")
            s.proc = _completed(s, codes, extra=tail)
            return todo[i + 1:]
        return []


def _read_code(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["returncode"])
    except (OSError, ValueError, KeyError):
        return None


def _read_seconds(path: Path) -> float:
    try:
        return float(json.loads(path.read_text())["seconds"])
    except (OSError, ValueError, KeyError):
        return float("nan")


def _completed(s: _Step, codes: list[int | None], extra: str = "") -> subprocess.CompletedProcess[str]:
    def joined(suffix: str) -> str:
        parts = []
        for r in range(len(codes)):
            f = s.out / f"rank{r}.{suffix}"
            parts.append(f.read_text(errors="replace") if f.is_file() else "")
        return "".join(parts)

    code = next((c for c in codes if c), 0) if all(c is not None for c in codes) else 1
    args = [str(MPIRUN), "-np", str(s.case.np), sys.executable, "-m", "pipeflow.train", *s.case.args]
    return subprocess.CompletedProcess(args, code, joined("out"), joined("err") + extra)


@pytest.fixture(scope="session", autouse=True)
def _mpi_batches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Batches]:
    """Set up before the first test: the batches start then, in the background (`Batches.start`)."""
    batches = Batches(request.session.items, tmp_path_factory.mktemp("mpi"), request.config)
    request.config.stash[BATCHES] = batches
    batches.start()
    yield batches
    batches.stop()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    batches = config.stash.get(BATCHES, None)
    if batches is None or not batches.launches:
        return
    runs = ", ".join(f"-np {n}: {k} case{'s' * (k != 1)} in {t:.0f} s" for n, k, t in batches.launches)
    terminalreporter.write_line(f"batched distributed cases: {len(batches.launches)} mpirun launches ({runs})")


# ------------------------------------------------------------------------------ background launches


BACKGROUND = pytest.StashKey["Background"]()
BACKGROUND_WAIT_S = 1500.0  # what a test may wait for its body's run (those before it, then its own)


class Background:
    """The selected `in_background` tests' bodies, run one after the other in a thread (module docstring)."""

    def __init__(self, items: list[pytest.Item], root: Path) -> None:
        self.items = [i for i in items if _background(i) and isinstance(i, pytest.Function)]
        self.kwargs: dict[str, dict[str, Any]] = {}
        for n, item in enumerate(self.items):
            assert isinstance(item, pytest.Function)
            given = item.callspec.params if hasattr(item, "callspec") else {}
            kwargs: dict[str, Any] = {}
            for name in item._fixtureinfo.argnames:
                if name == "tmp_path":
                    kwargs[name] = root / f"{n}-{re.sub(r'[^A-Za-z0-9_.=-]+', '_', item.name)[-60:]}"
                    kwargs[name].mkdir(parents=True)
                elif name in given:
                    kwargs[name] = given[name]
                else:
                    raise pytest.UsageError(f"{item.nodeid}: a test run in the background may take only tmp_path "
                                            f"and its parameters, not the fixture {name!r}")
            self.kwargs[item.nodeid] = kwargs
        self.done = {i.nodeid: threading.Event() for i in self.items}
        self.errors: dict[str, BaseException | None] = {}
        self.queue = list(self.items)  # not started yet, in collection order
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.stopping = False

    def start(self) -> None:
        if self.items and os.environ.get("PIPEFLOW_TEST_NO_BATCH") != "1":
            self.thread = threading.Thread(target=self._run_all, name="background-tests", daemon=True)
            self.thread.start()

    def _take(self, item: pytest.Item | None = None, *, last: bool = False) -> pytest.Item | None:
        """`item` if it has not started, else None; without one, the first (or `last`) not started."""
        with self.lock:
            if self.stopping or not self.queue:
                return None
            if item is None:
                return self.queue.pop(-1 if last else 0)
            if item in self.queue:
                self.queue.remove(item)
                return item
            return None

    def _run(self, item: pytest.Item) -> None:
        was = getattr(_IN_BACKGROUND, "on", False)
        _IN_BACKGROUND.on = True  # its processes get the session's start environment wherever it runs
        try:
            item.obj(**self.kwargs[item.nodeid])  # type: ignore[attr-defined]
            self.errors[item.nodeid] = None
        except BaseException as e:  # the test raises it in its turn
            self.errors[item.nodeid] = e
        finally:
            _IN_BACKGROUND.on = was
            self.done[item.nodeid].set()

    def _run_all(self) -> None:
        _behind_the_foreground()
        self.run_all()

    def run_all(self) -> None:
        """Run the bodies not started yet, one after the other, until none is left (also called by a batch lane
        that has run its last unit)."""
        while (item := self._take()) is not None:
            self._run(item)

    def outcome(self, item: pytest.Item) -> bool:
        """Raise what the item's body raised in the background; False if it was not run there. The foreground,
        arriving at a body that has not started, runs it itself, and while the thread runs the one it waits for,
        runs the last not started: the two then share what is left instead of the foreground waiting for it."""
        if self.thread is None or item.nodeid not in self.done:
            return False
        deadline = time.monotonic() + BACKGROUND_WAIT_S
        while not self.done[item.nodeid].is_set():
            mine = self._take(item) or self._take(last=True)
            if mine is not None:
                self._run(mine)
            elif not self.done[item.nodeid].wait(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"the background run of {item.nodeid} did not end within "
                                     f"{BACKGROUND_WAIT_S:.0f} s")
        if item.nodeid not in self.errors:
            raise AssertionError(f"the background run of {item.nodeid} did not start (the session is stopping)")
        error = self.errors[item.nodeid]
        if error is not None:
            raise error
        return True


@pytest.fixture(scope="session", autouse=True)
def _background_tests(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[Background]:
    """Started before the first test, with the batches (`Background.start`)."""
    background = Background(request.session.items, tmp_path_factory.mktemp("background"))
    request.config.stash[BACKGROUND] = background
    background.start()
    yield background
    background.stopping = True


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """An `in_background` test: its body already ran (or runs) in the background; report its outcome."""
    background = pyfuncitem.config.stash.get(BACKGROUND, None)
    if background is not None and background.outcome(pyfuncitem):
        return True
    return None


@pytest.fixture
def mpi(request: pytest.FixtureRequest, _mpi_batches: Batches) -> MpiRun:
    """The outputs of this test's batched case(s) (`@batched(build)`, see the module docstring)."""
    build = _builder(request.node)
    if build is None:
        pytest.fail("the mpi fixture needs @batched(build) on the test")
    key = _key(build, _params(request.node, build))
    run = _mpi_batches.result(key)
    for i, (s, proc) in enumerate(zip(_mpi_batches.steps[key], run.procs)):
        if s.case.check and proc.returncode != 0:
            raise AssertionError(f"case {i + 1} of {len(run.procs)}: {' '.join(map(str, proc.args))} exited "
                                 f"{proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return run


@pytest.fixture(autouse=True)
def one_thread() -> None:
    """Every in-process test runs torch on one thread, as a rank under mpirun does. With two, torch's OpenMP
    workers wait for each other by spinning: beside the batches' ranks on the 2-core machine, a test taking 0.3 s
    alone took 6 s. A test that needs another count sets it itself."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def one_rank_group() -> Iterator[Any]:
    """A gloo world of one in this process: the reducer's collectives run, the sums are the inputs."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
