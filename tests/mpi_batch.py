"""Many `pipeflow-train` runs in one MPI job, one after the other in the same processes.

    mpirun -np N python -m tests.mpi_batch cases.json

`cases.json` is a list of {"id", "args", "env", "timeout", "out", "before"}; rank 0 calls `before` (a
"module:function" and its arguments, tests/conftest.py's Case), then every rank runs
`pipeflow.train.main(args)` for each case in order, with `env` added to os.environ, and writes into
the case's `out` directory:

    rank<R>.out, rank<R>.err   what the rank printed (file descriptors 1 and 2, so C-level output,
                               faulthandler dumps and MPI's own messages too)
    rank<R>.json               {"returncode": ..., "seconds": ...}, written after main returned: its
                               absence means the case did not finish (it aborted the job or timed out)

A case that returns non-zero does not stop the others; one that calls MPI Abort, or runs past its
`timeout` (then every thread's stack goes to rank<R>.err and the rank exits), ends the job: the
pytest side (tests/conftest.py) reports that case and starts a new job for the cases after it.
Start-up (python, torch, mpi4py, torch._dynamo on the first optimizer step) is paid once per job.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def run_case(case: dict[str, Any], rank: int) -> int:
    """pipeflow.train.main(case["args"]) (or the case's own "main", "module:function") with this rank's
    output in the case's files; its exit code."""
    import importlib

    module, _, name = (case.get("main") or "pipeflow.train:main").partition(":")
    entry = getattr(importlib.import_module(module), name)
    out = Path(case["out"])
    out.mkdir(parents=True, exist_ok=True)
    saved_env = {k: os.environ.get(k) for k in case["env"]}
    os.environ.update(case["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    with open(out / f"rank{rank}.out", "wb") as fo, open(out / f"rank{rank}.err", "wb") as fe:
        os.dup2(fo.fileno(), 1)
        os.dup2(fe.fileno(), 2)
        # A hung case dumps every thread's stack into its .err and ends the job (mpirun sees a rank exit).
        faulthandler.dump_traceback_later(case["timeout"], exit=True)
        try:
            code = entry(case["args"])
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            faulthandler.cancel_dump_traceback_later()
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return code


def start_up() -> None:
    """Import what every case needs once, without the cyclic garbage collector, then freeze it.

    Importing torch, torch._dynamo (which torch.optim imports at the first optimizer) and the runtime
    makes ~450k objects that live as long as the process; the collector's passes over them during the
    imports and later, in every full collection of every case, were a third of a small batch's CPU time
    (perf). Frozen, they are left out of the passes; the cases' own objects are collected as before.
    """
    gc.disable()
    try:
        import torch._dynamo  # noqa: F401

        import pipeflow.train  # noqa: F401
    finally:
        gc.freeze()
        gc.enable()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: mpirun -np N python -m tests.mpi_batch cases.json", file=sys.stderr)
        return 2
    start_up()
    from pipeflow.control import Control

    comm = Control.world()  # its waits leave the core to the ranks still working (pipeflow.control.quiet_wait)
    rank = comm.rank
    cases = json.loads(Path(argv[0]).read_text())
    for case in cases:
        failed = None
        if case.get("before") and rank == 0:
            try:
                from tests.conftest import call_before

                call_before(case["before"])
            except BaseException:  # the case fails with it; the others run (every rank must go on together)
                failed = traceback.format_exc()
        # Every rank starts a case together (no message of the previous one is pending), knowing whether
        # its `before` failed.
        failed = comm.bcast(failed, root=0)
        comm.barrier()
        t0 = time.perf_counter()
        if failed is None:
            code = run_case(case, rank)
        else:
            out = Path(case["out"])
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank}.out").write_text("")
            (out / f"rank{rank}.err").write_text(f"the case's before {case['before']} failed:\n{failed}"
                                                 if rank == 0 else "")
            code = 1
        result = {"returncode": code, "seconds": round(time.perf_counter() - t0, 3)}
        (Path(case["out"]) / f"rank{rank}.json").write_text(json.dumps(result))
    comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
