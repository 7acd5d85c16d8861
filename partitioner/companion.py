"""pipeflow-profile --ranks-per-host N: how much N - 1 busy ranks slow this one. The model's forward and backward
passes are timed alone and while N - 1 companion processes run the model again and again, as the other ranks of
a host do in training; the ratio is profile.json's `contention`, which the planner applies to a plan as far as
its ranks compute at once (partitioner/price.py).

Issue 13: two ranks computing at once slow each other (on CPU they share the caches and the memory bandwidth;
on a GPU host, the host's cores and memory): a layer timed in a lone process is faster than the same layer in
a rank beside busy ones (benchmarks/planner/README.md measured 1.07x on the CPU gpt row), and by how much
depends on how much of the time the other ranks compute (a data-parallel rank's peers always do; a pipeline's
wait for each other). Each companion is a
child process (`python -m partitioner.companion CONFIG`) that rebuilds the model by name, says "ready" once its
first pass is done, and stops when its standard input closes: when the profiler is done, or dies."""
from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import torch

from partitioner.chain import time_chain, windows
from partitioner.layermem import sandbox_copy
from partitioner.measure import as_a_rank, cast_floats_to, free_cached, map_tensors, prepare_input, tensors
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.received import received
from pipeflow.spec import ModelSpec, build_model, model_dtype
from pipeflow.split import gemm_accumulation

READY = "ready"
READY_TIMEOUT_S = 600.0  # the first pass of a large model on a CPU
STOP_TIMEOUT_S = 30.0


class CompanionError(RuntimeError):
    """A companion could not start its work (one line: which, and why)."""


def companion_devices(device: str, index: int | None, count: int, gpus: int) -> list[str]:
    """The device of each of `count` companions: on CPU the CPU (the cores are shared, as the ranks share them),
    on CUDA the GPUs after the profiled one, one each, as a host's ranks have (`gpus` visible)."""
    if device != "cuda":
        return ["cpu"] * count
    if count + 1 > gpus:
        raise CompanionError(f"--ranks-per-host {count + 1} on cuda needs {count + 1} GPUs, one per rank, but "
                             f"{gpus} {'is' if gpus == 1 else 'are'} visible")
    first = index or 0
    return [f"cuda:{(first + k) % gpus}" for k in range(1, count + 1)]


def _lines(stream: IO[str], out: queue.Queue[str | None]) -> None:
    for line in stream:
        out.put(line.strip())
    out.put(None)


@contextmanager
def companions(config: dict[str, Any], devices: list[str], warnings: list[str] | None = None) -> Iterator[None]:
    """Run one companion per entry of `devices` (each with `config` and its device) for the duration of the
    block; every one has finished its first pass when the block starts. A companion that fails first raises
    CompanionError with the last line it wrote to stderr; one that stops before the block ends appends a line
    to `warnings` (what was timed after it, was timed without it)."""
    procs: list[subprocess.Popen[str]] = []
    errs = [tempfile.TemporaryFile("w+") for _ in devices]  # a file, not a pipe: a chatty companion never blocks

    def last_error(k: int) -> str:
        errs[k].seek(0)
        return ([x for x in errs[k].read().splitlines() if x.strip()] or ["no message"])[-1].strip()

    try:
        for dev, err in zip(devices, errs):
            procs.append(subprocess.Popen([sys.executable, "-m", "partitioner.companion",
                                           json.dumps({**config, "device": dev})],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                          text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        for k, (proc, dev) in enumerate(zip(procs, devices)):
            lines: queue.Queue[str | None] = queue.Queue()
            assert proc.stdout is not None
            threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
            deadline = time.monotonic() + READY_TIMEOUT_S
            line: str | None = ""
            while line not in (READY, None):  # the model's own prints come first, if any
                try:
                    line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise CompanionError(f"the companion on {dev} did not finish a pass in {READY_TIMEOUT_S:.0f} s"
                                         ) from None
            if line is None:
                proc.wait(timeout=STOP_TIMEOUT_S)
                raise CompanionError(f"the companion on {dev} failed (exit {proc.returncode}): {last_error(k)}")
        yield
        for k, (proc, dev) in enumerate(zip(procs, devices)):
            if proc.poll() is not None and warnings is not None:
                warnings.append(f"the companion on {dev} stopped before the profile ended (exit {proc.returncode}: "
                                f"{last_error(k)}): the layers timed after it were timed without it")
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()  # its cue to stop
        for proc in procs:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for err in errs:
            err.close()

def contention(spec: ModelSpec, layers: list[dict[str, Any]], x: Any, dev: torch.device, dtype: torch.dtype | None, *,
               warmup: int, repeats: int, fuse: bool, config: dict[str, Any], devices: list[str],
               warnings: list[str] | None) -> float:
    """A forward and backward pass over the model's first layers (those whose bytes, `layers`' stats, fit in half
    the device's free memory) beside the companions on `devices`, over the same pass alone: the median pass of
    `repeats`, alone before and after (a machine's drift between them cancels)."""
    _, count = next(windows(layers, dev))
    works = [sandbox_copy(layer, dev, dtype, fuse=fuse) for layer in spec.layers[:count]]

    def passes() -> list[float]:
        return time_chain(works, x, dev, warmup=warmup, repeats=repeats).passes

    alone = passes()
    with companions(config, devices, warnings):
        beside = passes()
    alone += passes()
    works.clear()
    free_cached(dev)
    return statistics.median(beside) / statistics.median(alone)


def _work(config: dict[str, Any], stop: threading.Event) -> None:
    """Forward, loss and backward of the model (or of as many of its first layers as fit), pass after pass,
    gradients accumulating over two passes as over a step's microbatches, until `stop`."""
    dev = torch.device(config["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dtype = getattr(torch, config["dtype"]) if config.get("dtype") else None
    spec = build_model(config["model"], config.get("model_args") or {}, seed=config.get("seed", 0))
    fuse = gemm_accumulation()
    with as_a_rank(dev, config.get("threads")):
        x, y = MicrobatchLoader(spec.dataset, config["microbatch_size"], seed=config.get("seed", 0)).microbatch(0)
        x = cast_floats_to(x, dtype or model_dtype(torch.nn.ModuleList(spec.layers)))
        y = map_tensors(y, lambda t: t.to(dev))
        count = len(spec.layers)
        while True:
            try:
                layers = [sandbox_copy(layer, dev, dtype, fuse=fuse) for layer in spec.layers[:count]]
                passes = 0
                while not stop.is_set() or passes == 0:
                    if passes % 2 == 0:
                        for layer in layers:
                            layer.zero_grad(set_to_none=True)
                    h = received(prepare_input(x, dev, None))
                    for layer in layers:
                        h = layer(h)
                    if count == len(spec.layers):
                        spec.loss_fn(h, y).backward()
                    else:
                        ys = [t for t in tensors(h) if t.requires_grad]
                        torch.autograd.backward(ys, [torch.ones_like(t) for t in ys])
                    if dev.type == "cuda":
                        torch.cuda.synchronize()  # a bounded queue: it stops soon after its cue
                    if passes == 0:
                        print(READY, flush=True)
                    passes += 1
                return
            except torch.OutOfMemoryError:
                if count == 1:
                    raise
                layers = []
                torch.cuda.empty_cache()
                count //= 2  # a model too large for one device: its first layers are work enough


def main(argv: list[str] | None = None) -> int:
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    stop = threading.Event()

    def watch() -> None:
        sys.stdin.read()  # returns when the profiler closes the pipe, or exits
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        _work(config, stop)
    except Exception as e:  # reported to the profiler as one line on stderr
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

