"""Two ranks, one late: how much CPU the other spends waiting for it in each of pipeflow.control's waits (a
receive, an element-wise maximum, a gather, a barrier), written to argv[0] as JSON by rank 0 (tests/test_host.py).
Run by the batches as `Case(2, [path], main="tests.quiet_ranks:main")`."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

LATE_S = 0.6
TAG = 0x51E


def main(argv: list[str]) -> int:
    from pipeflow.control import Control

    comm = Control.world()
    waits = {
        "recv": lambda: comm.recv(source=1, tag=TAG) if comm.rank == 0 else comm.send(b"late", dest=0, tag=TAG),
        "allreduce_max": lambda: comm.allreduce_max(np.zeros(2, dtype=np.int64)),
        "allgather": lambda: comm.allgather(comm.rank),
        "barrier": comm.barrier,
    }
    spent = {}
    for name, wait in waits.items():
        comm.barrier()
        if comm.rank == 1:
            time.sleep(LATE_S)
        wall, cpu = time.perf_counter(), time.process_time()
        wait()
        spent[name] = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    if comm.rank == 0:
        with open(argv[0], "w") as f:
            json.dump(spent, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
