"""What `pipeflow-profile` measures besides each layer, under the conditions of training (issue 13): the
timer, the torch thread count of a rank, the loss, the optimizer step per parameter byte, and how much the
repeats disagree (a busy machine makes every prediction from the profile wrong: say so)."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from pipeflow.hostmem import keep_freed_host_memory
from pipeflow.tensorops import copy_weights, nonfinite_flag

# A rank under mpirun runs one torch thread per process on CPU (issue 13: the profile taken with 2 threads
# predicted 2x the speed training got); pipeflow-profile times the layers the same way unless told otherwise.
RANK_THREADS = 1
# Repeats disagreeing by more than this (slowest pass over the layers / median pass) mean a noisy machine.
NOISY_SPREAD = 1.2
# The optimizer step is timed on at most this many parameter bytes (a prefix of the model's parameters):
# its cost per byte is what the planner uses, and a copy of a large model's state may not fit twice. Each timing
# runs UPDATES back to back, so that what one call costs from an idle device (its first launch, the final sync)
# is not charged per byte: on 2 x H200 (GPT stage 0, 1.44 GB of bf16 weights, benchmarks/gpu/README.md) one
# update of a 256 MiB sample timed alone priced the stage's update at 7.4 ms where it took 4.5 ms. On a CPU, where
# a call has no such cost and a GiB takes seconds an update, the sample stays at 256 MiB.
OPTIMIZER_SAMPLE_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}
UPDATES = 4


def _not_sequence(x: Any) -> bool:
    """Pytree leaves here: everything but tuples, lists and dicts (what a layer's data may nest: structure.py)."""
    return not isinstance(x, (tuple, list, dict))


def tensors(x: Any) -> Iterator[torch.Tensor]:
    """The tensors of a layer's input or output (a tensor, or tuples, lists and dicts of them), in order."""
    return (t for t in tree_leaves(x, is_leaf=_not_sequence) if isinstance(t, torch.Tensor))


def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`x` with `fn` applied to each of its tensors; its tuples, lists and other values kept."""
    return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, x, is_leaf=_not_sequence)


def prepare_input(x: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Detached copies on the device; floating ones (in `dtype` if given) requiring grad, as a stage's
    received activations are."""
    def prep(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(device)
        if t.is_floating_point():
            t = (t if dtype is None else t.to(dtype)).requires_grad_(True)
        return t
    return map_tensors(x, prep)


def nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(x))


def cast_floats_to(x: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return x
    return map_tensors(x, lambda t: t.to(dtype) if t.is_floating_point() else t)


def free_cached(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def machine_bytes(device: torch.device) -> tuple[int, str]:
    """Memory a microbatch must fit in: the GPU's on cuda, the host's RAM otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"GPU {device}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


class Timer:
    """Milliseconds of a callable: perf_counter on CPU; on CUDA, by default, CUDA events around it from an idle
    device (what pipeflow-profile uses); with `held`, its kernels' device time back to back.

    A running stage's host launches kernels ahead of the device when it can, so timing a layer alone from an
    idle device adds the device's wait for each launch, while its kernels back to back leave out the host
    where the host is the slower one. On 2 x H100 (GPT 24 x 2048, benchmarks/gpu/README.md, "The profile
    against the stage") the first over-priced the 2-stage pipelines at microbatch 2 by 13-16% and the second
    under-priced them by 16-22%: the stages are partly host-bound there. At microbatch 8 the first was within
    6% and a held variant 9-10% fast. The first is `--timing idle` (the default on CPU), the second `--timing
    kernels`; on CUDA the default times each layer inside the chain a stage runs instead (partitioner.chain).

    Held: the device is first kept busy (torch.cuda._sleep) while the host launches `fn`'s kernels, and the
    events around them time the kernels back to back. Launches that outlast the hold make the next call's hold
    longer (warm-up calls find the length); a callable that waits for the device (a host sync inside it) is
    timed from an idle device after that. The host's launch time under the hold (`host_ms`) is not counted:
    it read 2x the host's share of a running stage."""

    HOLD_MS = 10.0  # the first hold; a call whose launches outlast 0.4 of it makes the next hold longer
    MAX_HOLD_MS = 160.0  # launches that outlast even this: the callable waits for the device; time from idle
    CLOCK_HZ = 2.0e9  # cycles per second torch.cuda._sleep spins at most (a slower clock holds longer)

    def __init__(self, device: torch.device, *, held: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.held = held
        self.hold_ms = self.HOLD_MS
        self.host_ms = 0.0  # the last call's host time

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Calls `fn` once (it may not be repeatable: a backward) and returns its milliseconds."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            self.host_ms = (time.perf_counter() - t0) * 1e3
            return self.host_ms
        if not self.held:
            return self._events(fn, None)
        device_ms = self._events(fn, self.hold_ms)
        if self.host_ms >= 0.4 * self.hold_ms:  # some launches came after the hold: this call counts some gaps
            if self.hold_ms >= self.MAX_HOLD_MS:  # the host waits for the device inside fn: time from idle
                self.held = False
            self.hold_ms = min(self.MAX_HOLD_MS, max(4 * self.hold_ms, 3 * self.host_ms))
        return device_ms

    def _events(self, fn: Callable[[], Any], hold_ms: float | None) -> float:
        """CUDA events around `fn`, from an idle device or (hold_ms) after the device is held that long."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if hold_ms is not None:
            torch.cuda._sleep(int(hold_ms * 1e-3 * self.CLOCK_HZ))
        start.record()
        t0 = time.perf_counter()
        fn()
        self.host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end))


@contextmanager
def as_a_rank(device: torch.device, threads: int | None) -> Iterator[None]:
    """Time as a rank runs: with `threads` torch intra-op threads (None: as the process is; the count is restored
    after) and, on CPU, freed memory kept for reuse (pipeflow.hostmem; for good, as in a rank)."""
    if device.type == "cpu":
        keep_freed_host_memory()
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def time_loss(loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], output: Any, target: Any, timer: Timer, *,
              warmup: int, repeats: int) -> float:
    """Median ms of the loss's forward and backward on the last layer's output (what the last stage adds
    to every microbatch)."""
    times = []
    holder: dict[str, torch.Tensor] = {}

    def forward() -> None:
        holder["loss"] = loss_fn(output, target)

    for it in range(warmup + repeats):
        t = timer(forward) + timer(lambda: holder["loss"].backward())
        if it >= warmup:
            times.append(t)
    return statistics.median(times)


def make_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer pipeflow-train builds (pipeflow/runner.py, default flags)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.0)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    fused = bool(params) and all(p.is_cuda for p in params)
    return cls(params, lr=1e-3, fused=fused or None)


def optimizer_ms_per_byte(name: str, parameters: Iterable[torch.Tensor], timer: Timer, *, warmup: int,
                          repeats: int) -> tuple[float, float] | None:
    """Median ms per parameter byte of (1) one update as a rank runs it, the non-finite check of the gradients
    (pipeflow/tensorops.py) and the optimizer step, and (2) one copy of the weights, as the asynchronous
    schedules keep a version (tensorops.copy_weights, as pipeflow/stash.py does); on copies of (a prefix of) the
    parameters with random gradients; None when there are no parameters. The first step, which allocates the
    state, is never timed."""
    params: list[torch.Tensor] = []
    nbytes = 0
    for p in parameters:
        if nbytes >= OPTIMIZER_SAMPLE_BYTES.get(p.device.type, OPTIMIZER_SAMPLE_BYTES["cpu"]):
            break
        q = p.detach().clone().requires_grad_(True)
        q.grad = torch.randn_like(q)
        params.append(q)
        nbytes += q.numel() * q.element_size()
    if not nbytes:
        return None
    opt = make_optimizer(name, params)
    opt.step()
    device = params[0].device
    ones: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # the check's scale tensors, made once
    grads = [q.grad for q in params if q.grad is not None]

    def update() -> None:
        nonfinite_flag(grads, device, ones)
        opt.step()

    def copies() -> None:
        for _ in range(UPDATES):
            copy_weights(stashed, params)

    def updates() -> None:
        for _ in range(UPDATES):
            update()

    stashed = [torch.empty_like(q) for q in params]
    copied = [timer(copies) for _ in range(warmup + repeats)][warmup:]
    times = [timer(updates) for _ in range(warmup + repeats)][warmup:]
    return statistics.median(times) / UPDATES / nbytes, statistics.median(copied) / UPDATES / nbytes


def spread(per_repeat_ms: Sequence[float]) -> float:
    """The slowest repeat over the median one (1.0 for one repeat or equal repeats)."""
    med = statistics.median(per_repeat_ms)
    return max(per_repeat_ms) / med if med > 0 else 1.0


def noise_warning(ratio: float, repeats: int) -> str | None:
    """The warning for a noisy profile (None when the repeats agree within NOISY_SPREAD)."""
    if ratio <= NOISY_SPREAD:
        return None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"timings vary between repeats: the slowest of {repeats} passes over the layers took {ratio:.2f} x the "
            f"median (warning above {NOISY_SPREAD}); load average {load:.1f} on {os.cpu_count()} cores. Plans "
            "predicted from this profile will be off: profile on an idle machine or raise --repeats")


def gpu_link_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 3) -> float | None:
    """Bytes/s of a copy from `device` to the next visible GPU (NVLink or PCIe, whichever torch uses), the
    median of `repeats` after one warm-up; None with fewer than two GPUs. What the planner's default
    topology uses on a GPU host (issue 13: it assumed 10 GB/s even on NVLink)."""
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return None
    src = device.index if device.index is not None else torch.cuda.current_device()
    dst = (src + 1) % torch.cuda.device_count()
    x = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    y = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    times = []
    for it in range(1 + repeats):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        if it:
            times.append(time.perf_counter() - t0)
    del x, y
    return nbytes / statistics.median(times)
