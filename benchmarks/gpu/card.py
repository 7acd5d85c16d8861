"""Run a module (pipeflow.train) on a smaller card than the one there: each rank's CUDA memory held to GIB GiB.

    mpirun -np 2 python3 -m benchmarks.gpu.card 79.1 pipeflow.train --model gpt ...

An H100 SXM's 80 GB show as 79.1 GiB to CUDA; the GPU machines may lend H200s (139 GiB) for it. When the rank
picks its GPU (torch.cuda.set_device), its caching allocator is capped (torch.cuda.set_per_process_memory_fraction)
at GIB less what the device already holds then (the CUDA context) and less RESERVE for what comes outside the
allocator later (NCCL's and the copy engines' buffers): an allocation past it fails as it would on the small card.
A thread reads the device's memory in use (cudaMemGetInfo, nvidia-smi's figure: context, NCCL and the allocator's
reserve together; one rank per GPU) every 0.2 s; at exit each rank prints one line::

    CARD rank 0 cuda:0: held to 79.1 GiB (allocator 77.6): peak in use 66.02 GiB, allocator peak reserved 64.98 GiB

and `over` where the peak in use passed GIB (then the run would not have fitted).
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading

import torch

RESERVE_GIB = 1.0  # room left outside the allocator for NCCL's and the copy engines' buffers (made after the cap)
GIB = 2**30


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python3 -m benchmarks.gpu.card GIB MODULE [ARGS...]  (e.g. 79.1 pipeflow.train ...)")
    try:
        card = float(sys.argv[1])
    except ValueError:
        sys.exit(f"benchmarks.gpu.card: expected the card's memory in GiB (e.g. 79.1), found {sys.argv[1]!r}")
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    seen: dict[str, float] = {}
    real_set_device = torch.cuda.set_device
    stop = threading.Event()
    watcher: list[threading.Thread] = []

    def watch(index: int) -> None:
        while not stop.is_set():
            free, total = torch.cuda.mem_get_info(index)
            seen["peak"] = max(seen.get("peak", 0.0), (total - free) / GIB)
            stop.wait(0.2)

    def set_device(device: object) -> None:
        real_set_device(device)  # type: ignore[arg-type]
        index = torch.cuda.current_device()
        if "index" in seen:
            return
        free, total = torch.cuda.mem_get_info(index)
        allowed = card * GIB - (total - free) - RESERVE_GIB * GIB
        if allowed <= 0:
            sys.exit(f"benchmarks.gpu.card: a {card:g} GiB card leaves nothing once the context holds "
                     f"{(total - free) / GIB:.2f} GiB")
        torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), index)
        seen.update(index=index, allocator=allowed / GIB)
        watcher.append(threading.Thread(target=watch, args=(index,), daemon=True))
        watcher[0].start()

    def report() -> None:
        if "index" not in seen:
            return
        # Joined before the interpreter finalises: a daemon thread left inside a CUDA call then is unwound through
        # C++ frames that cannot unwind ("terminate called without an active exception", exit 6 after the result).
        stop.set()
        watcher[0].join()
        index = int(seen["index"])
        peak = seen.get("peak", 0.0)
        reserved = torch.cuda.max_memory_reserved(index) / GIB
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
        print(f"CARD rank {rank} cuda:{index}: held to {card:g} GiB (allocator {seen['allocator']:.1f}): peak in use "
              f"{peak:.2f} GiB, allocator peak reserved {reserved:.2f} GiB" + (" over" if peak > card else ""),
              file=sys.stderr, flush=True)

    torch.cuda.set_device = set_device  # type: ignore[assignment]
    atexit.register(report)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
