"""pipeflow-train with a GPU's device-wide wait emulated on CPU (the interleaved hang on 2 H100s, issue 14).

On a GPU, a rank's first use of a library (cuBLAS's handle, a fresh allocation) can wait for every kernel
the rank has queued, posted NCCL receives included, and a posted receive runs until the peer sends. Here
each process's first stage forward waits for every receive the process posted before it. A rank that posts,
ahead of its use, a receive whose sender is itself waiting on this rank (for shapes this rank sends later)
then hangs on CPU as it hung on the GPU.

    mpirun -np 2 python -m tests.device_sync PIPEFLOW-TRAIN-ARGS...
"""
from __future__ import annotations

import sys
from typing import Any


def main(argv: list[str]) -> int:
    from pipeflow import comm, stage, train

    posted: list[Any] = []
    recv, forward = comm.P2P.recv, stage.Stage.forward
    first = [True]

    def recording_recv(self: Any, *args: Any, **kwargs: Any) -> Any:
        bufs, works = recv(self, *args, **kwargs)
        posted.extend(works)
        return bufs, works

    def waiting_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if first[0]:
            first[0] = False
            for work in posted:  # what a device-wide wait does to the receives queued on the GPU
                if not work.is_completed():  # (gloo's wait on a work already waited for never returns)
                    work.wait()
        return forward(self, *args, **kwargs)

    comm.P2P.recv, stage.Stage.forward = recording_recv, waiting_forward  # type: ignore[method-assign]
    try:
        return train.main(argv)
    finally:
        comm.P2P.recv, stage.Stage.forward = recv, forward  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
