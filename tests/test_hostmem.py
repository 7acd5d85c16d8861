"""CPU ranks and CPU profiling keep freed host memory (pipeflow/hostmem.py): training steps reuse the memory of
the last step's gradients and optimizer temporaries instead of faulting fresh pages in."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeflow.hostmem import keep_freed_host_memory
from tests.conftest import base_env, in_background

glibc = pytest.mark.skipif("CS_GNU_LIBC_VERSION" not in os.confstr_names
                           or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's malloc only")

# After SETUP, prints whether glibc (1) keeps four freed 120 KiB blocks at the heap's top instead of trimming them
# back to the OS (480 KiB, past the default trim threshold of 128 KiB whatever the heap's top held before) and
# (2) serves a 64 MiB block from the heap instead of mapping it afresh (and unmapping it when
# freed): "True True" when freed memory is kept, "False False" with glibc's defaults.
PROBE = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
{setup}
small = [libc.malloc(120 * 2**10) for _ in range(4)]
top = libc.sbrk(0)
for block in reversed(small):
    libc.free(block)
kept_top = libc.sbrk(0) == top
big = libc.malloc(64 * 2**20)
print(kept_top, big < libc.sbrk(0))
libc.free(big)
"""


def probe(setup: str) -> str:
    env = {k: v for k, v in base_env().items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], capture_output=True, text=True, env=env,
                         check=True)
    return out.stdout.strip().splitlines()[-1]


@glibc
@in_background
def test_glibc_defaults_trim_and_map_afresh():  # what the setting changes
    assert probe("") == "False False"


@glibc
@in_background
def test_kept_memory_stays_in_the_heap():
    assert probe("from pipeflow.hostmem import keep_freed_host_memory; assert keep_freed_host_memory()") == "True True"


@glibc
@in_background
def test_cpu_profiling_runs_as_the_ranks_do():
    assert probe("from partitioner.profiler import profile_model; from pipeflow.models import mlp\n"
                 "profile_model(mlp.build(layers=2, hidden=8, d_in=4, samples=8), 2, 'cpu', repeats=1, warmup=0)"
                 ) == "True True"


@glibc
@in_background
def test_a_cpu_world_keeps_freed_memory():
    assert probe("from pipeflow.comm import init_world; init_world(device='cpu')") == "True True"


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "1"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=1"},
                                 {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}])
def test_the_users_own_allocator_choice_is_left_alone(env):
    assert keep_freed_host_memory(env) is False
