"""Host memory of a CPU rank: freed blocks stay in the process instead of going back to the OS."""
from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1   # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: hand back a heap top only above 2 GiB free
# Set by the user, these choose the allocator's behaviour themselves: then it is left as it is.
USER_CHOICES = ("GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                "MALLOC_TOP_PAD_")


def keep_freed_host_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Make glibc's malloc keep freed memory for reuse: no mmap for big blocks (M_MMAP_MAX 0) and no trimming
    of the heap below 2 GiB free (M_TRIM_THRESHOLD). Returns whether it did (glibc on Linux, no user choice).

    By default glibc maps every block above its mmap threshold (at most 32 MiB) afresh and unmaps it when freed,
    and returns the heap's free top to the OS: every step's gradients, optimizer temporaries and large
    activations then fault their pages back in, zeroed by the kernel. On the 2-core test machine that made Adam
    on three 2048 x 2048 layers take 44 ms instead of 22 and a pipelined hidden-2048 mlp train at 541-573
    samples/s instead of 665-675 (benchmarks/planner/README.md). The process keeps its peak host memory, as
    torch's CUDA caching allocator keeps device memory. CPU ranks and CPU profiling call it, so that the
    profile is timed as the ranks run."""
    preloaded = "malloc" in environ.get("LD_PRELOAD", "")  # jemalloc, tcmalloc, mimalloc: another allocator
    if not sys.platform.startswith("linux") or preloaded or any(k in environ for k in USER_CHOICES):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library; musl and others may lack it
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
