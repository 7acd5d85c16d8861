"""pipeflow-profile --timing stage: each layer timed inside the chain of layers a stage runs.

Issue 13: a layer timed alone, again and again, is not what it costs between other layers in a busy stage."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from partitioner.layermem import sandbox_copy
from partitioner.measure import NOISY_SPREAD, Timer, free_cached, machine_bytes, map_tensors, prepare_input, tensors
from pipeflow.received import received
from pipeflow.spec import ModelSpec
from pipeflow.tensorops import random_like


class Marks:
    """Points in a sequence of work, read after it: CUDA events recorded on the current stream (one sync when
    first read) or perf_counter on CPU. Nothing waits between marks, so each interval is what the work took in
    the sequence: its kernels where the device is the slower one, its launches where the host is."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.synced = False

    def stamp(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        if not self.cuda:
            return (b - a) * 1e3
        if not self.synced:
            torch.cuda.synchronize()
            self.synced = True
        return float(a.elapsed_time(b))


class Hold:
    """Keeps the device busy at the start of each pass while the host issues it (time_chain's `queued`): the hold
    grows to twice the longest pass the host took to issue, from Timer's first hold."""

    def __init__(self) -> None:
        self.ms = Timer.HOLD_MS
        self.t0 = 0.0

    def begin(self) -> None:
        torch.cuda._sleep(int(self.ms * 1e-3 * Timer.CLOCK_HZ))
        self.t0 = time.perf_counter()

    def end(self) -> None:
        host_ms = (time.perf_counter() - self.t0) * 1e3
        self.ms = min(Timer.MAX_HOLD_MS * 4, max(self.ms, 2 * host_ms))


@dataclass
class ChainTimes:
    """time_chain's result: per layer, the ms of each kept pass."""

    forward: list[list[float]]
    backward: list[list[float]]  # passes whose backward found no gradients
    accumulate: list[list[float]]  # passes whose backward accumulated into existing gradients
    passes: list[float]  # the total of each pass that did not accumulate (the spread between repeats)
    output: Any  # the chain's output, detached: the next window's input
    loss: list[float]  # with a loss: its forward and backward in each kept pass


# The model's loss function and a target: a chain that ends the model ends with them, as the last stage does.
Loss = tuple[Callable[[Any, Any], torch.Tensor], Any]

# Rounds of the chain's timing (pipeflow-profile --rounds), spaced ROUND_GAP_S apart; each window keeps its fastest.
# On the 2 x H200 hosts (a VM) the host's own pace moved by 2x from second to second, pinned to a core or not
# (benchmarks/gpu/README.md, "the host's pace"): a pure-Python loop took 38-90 ms, the GPT's forwards at microbatch
# 2 9.6-25 ms a round; the fastest round priced every row of a 4 x H200 host within 1.6%. A CPU keeps one round
# (its ranks share the cores with each other; the planner's CPU accuracy runs are measured so).
ROUNDS = {"cuda": 5, "cpu": 1}
ROUND_GAP_S = 0.5


def time_chain(layers: Sequence[Any], x: Any, device: torch.device, *, warmup: int, repeats: int,
               loss: Loss | None = None, queued: bool = False) -> ChainTimes:
    """Each layer's ms timed as a stage runs its layers (pipeflow-profile --timing stage): the forward of
    the whole chain, then one backward through it, pass after pass, nothing waiting between layers or passes
    (Marks, read once at the end; in the backward, a hook on each layer's outputs marks when their gradient
    is complete, which is when the layer's own backward starts). Where the device is the slower one it always
    has kernels queued, as in a running stage, whose host launches a forward while the previous backward still
    runs; where the host is, the marks show its pace. Each layer's weights come cold out of the cache, as in
    training. Timing one layer again and again from an idle device sees none of this; timing each layer's
    backward by its own call (a host round trip per layer) made the backward host-bound at small microbatches.

    Passes alternate between a backward into no gradients and one accumulating into them (every microbatch
    of a flushed step but the first); `warmup` passes first are not kept. A layer whose outputs get no
    gradient (a later layer cuts the chain) has no backward: 0. With `loss` the backward starts from the loss
    of the chain's output, as on the last stage, and the loss is timed there too: its forward after the last
    layer's, its backward until the last layer's outputs have their gradient (issue 15: timed alone, from its
    own output, the loss of GPT's last stage took 0.2-0.9 ms a microbatch more than inside the stage).

    `queued` (--timing graphs, CUDA): each pass starts behind a hold of the device (torch.cuda._sleep) long enough
    for the host to issue the whole pass first, so the marks time the kernels back to back in the chain, as a
    replayed CUDA graph runs them (pipeflow/graphs.py), whatever the host's pace; a pass whose launches outlast its
    hold makes the next hold longer (the warm-up passes find the length)."""
    n = len(layers)
    clock = Marks(device)
    x = map_tensors(x, lambda t: t.to(device))  # once: a copy from the host inside a pass would wait for it
    recorded: list[tuple[bool, list[Any], list[Any], dict[int, Any], Any]] = []
    gs: list[torch.Tensor] | None = None
    h: Any = None
    hold = Hold() if queued else None
    for it in range(warmup + 2 * repeats):
        accumulate = it % 2 == 1
        if hold is not None:
            hold.begin()
        if not accumulate:
            for layer in layers:
                layer.zero_grad(set_to_none=True)
        h = received(prepare_input(x, device, None))  # requiring grad, as a stage receives it (pipeflow/received.py)
        fwd_marks = [clock.stamp()]
        outs: list[Any] = []
        for layer in layers:
            h = layer(h)
            outs.append(h)
            fwd_marks.append(clock.stamp())
        at: dict[int, Any] = {}  # layer -> when its outputs' gradient was complete (the last hook to fire)
        for k in range(n - 1):
            for t in tensors(outs[k]):
                if t.requires_grad:
                    t.register_hook(lambda _g, k=k, at=at: at.__setitem__(k, clock.stamp()))
        ys = [t for t in tensors(h) if t.requires_grad]
        value, loss_mark = None, None
        if loss is not None:
            value = loss[0](h, loss[1])
            loss_mark = clock.stamp()
            for t in ys:  # the loss's backward ends when the last layer's outputs have their gradient
                t.register_hook(lambda _g, at=at: at.__setitem__(n - 1, clock.stamp()))
        elif gs is None:
            gs = [random_like(t) for t in ys]  # what the next stage would send
        ends = [clock.stamp()]
        if ys:
            torch.autograd.backward([value] if value is not None else ys, None if value is not None else gs)
        ends.append(clock.stamp())
        if hold is not None:
            hold.end()
        del outs, value
        if it >= warmup:
            recorded.append((accumulate, fwd_marks, ends, at, loss_mark))
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    acc: list[list[float]] = [[] for _ in range(n)]
    passes: list[float] = []
    losses: list[float] = []
    for accumulate, fwd_marks, (start, end), at, loss_mark in recorded:
        if loss_mark is not None:
            back = clock.ms(start, at[n - 1]) if n - 1 in at else 0.0
            losses.append(clock.ms(fwd_marks[n], loss_mark) + max(0.0, back))
        total = 0.0
        for k in range(n):
            f = clock.ms(fwd_marks[k], fwd_marks[k + 1])
            begin = start if k == n - 1 and (loss_mark is None or k not in at) else at.get(k)
            finish = at.get(k - 1, end) if k > 0 else end
            # A tensor passed through several layers (a skip connection carried in a tuple) completes its
            # gradient once, for all of them: their marks may coincide or cross; none takes negative time.
            b = max(0.0, clock.ms(begin, finish)) if begin is not None else 0.0
            fwd[k].append(f)
            (acc if accumulate else bwd)[k].append(b)
            total += f + b
        if not accumulate:  # the spread compares like passes: an accumulating backward takes longer
            passes.append(total)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return ChainTimes(fwd, bwd, acc, passes, map_tensors(h, lambda t: t.detach()), losses)


def layer_bytes(stats: dict[str, Any]) -> int:
    """What a layer holds while a chain runs through it: parameters and their gradients, saved activations,
    its output and that output's gradient."""
    return 2 * stats["parameter_bytes"] + stats["activation_bytes"] + 2 * stats["output_bytes"]


def windows(layers: list[dict[str, Any]], dev: torch.device, copies: int = 1) -> Iterator[tuple[int, int]]:
    """[start, end) of consecutive layers (their profile_layer numbers) whose bytes fit in half the device's free
    memory (on CPU a quarter of the machine's), in order; a layer larger than that is a window of its own."""
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else machine_bytes(dev)[0] // 2
    budget = free // (2 * copies)  # `copies` of each window's layers are resident at once
    start = 0
    while start < len(layers):
        end, need = start + 1, layer_bytes(layers[start])
        while end < len(layers) and need + layer_bytes(layers[end]) <= budget:
            need += layer_bytes(layers[end])
            end += 1
        yield start, end
        start = end


def fastest_rounds(variants: Sequence[Sequence[Any]], x: Any, device: torch.device, *, warmup: int, repeats: int,
                   rounds: int, losses: Sequence[Loss | None], queued: bool = False) -> list[tuple[ChainTimes, float]]:
    """Each variant of the same layers (autograd's accumulation and the GEMM's) timed `rounds` times, ROUND_GAP_S
    apart: per variant the round whose median pass took least, and the slowest round's median pass over it (how far
    the host's pace moved). The variants' rounds are taken in turn, so each meets the host's pace of the same
    seconds. Timed one after the other, the first could meet only a slow spell and the second only a fast one (2 x
    H200: forwards of 17.9 ms under autograd's 5 rounds, 9.7 ms under the GEMM's 5 after them), and the plan would
    price the wrong one."""
    kept: list[list[tuple[float, ChainTimes]]] = [[] for _ in variants]
    for r in range(rounds):
        if r:
            time.sleep(ROUND_GAP_S)
        for mine, layers, loss in zip(kept, variants, losses, strict=True):
            times = time_chain(layers, x, device, warmup=warmup, repeats=repeats, loss=loss, queued=queued)
            mine.append((statistics.median(times.passes), times))
    out = []
    for mine in kept:
        fastest = min(mine, key=lambda k: k[0])
        slowest = max(k[0] for k in mine)
        out.append((fastest[1], slowest / fastest[0] if fastest[0] > 0 else 1.0))
    return out


def time_as_a_stage(spec: ModelSpec, layers: list[dict[str, Any]], x: Any, dev: torch.device,
                     dtype: torch.dtype | None, *, warmup: int, repeats: int, fuse: bool = False,
                     target: Any = None, rounds: int = 1, warnings: list[str] | None = None,
                     twin: list[dict[str, Any]] | None = None,
                     queued: bool = False) -> tuple[list[float], float | None]:
    """--timing stage: replace each layer's forward and backward times in `layers` (profile_layer's numbers)
    with time_chain's, run over windows of consecutive layers whose bytes fit in half the free memory
    (a model too large for the device is timed a window at a time; the first layer of a window starts
    from a drained chain). A layer's share of its backward's weight gradients (backward_weight_ms) is kept.
    `fuse`: nn.Linear layers accumulate inside their GEMM (sandbox_copy). With `target` the last window ends
    with the model's loss on it. Returns the passes' totals, for the repeat spread, and the loss's median ms
    (None without `target`). Each window is timed `rounds` times; its fastest round is kept (fastest_rounds), and
    rounds that disagree by more than NOISY_SPREAD append a line to `warnings`. `twin` (a copy of `layers`) gets
    the same layers' times with the GEMM accumulating (fuse=True), their rounds in turn with these
    (fastest_rounds). `queued`: --timing graphs (time_chain)."""
    passes: list[float] = []
    loss_ms, moved = None, 1.0
    for start, end in windows(layers, dev, copies=2 if twin is not None else 1):
        variants = [[sandbox_copy(layer, dev, dtype, fuse=f) for layer in spec.layers[start:end]]
                    for f in ([fuse, True] if twin is not None else [fuse])]
        ends_model = target is not None and end == len(layers)
        timed = fastest_rounds(variants, x, dev, warmup=warmup, repeats=repeats, rounds=rounds,
                               losses=[(spec.loss_fn, target) if ends_model else None, None][:len(variants)],
                               queued=queued)
        moved = max(moved, timed[0][1])
        del variants
        free_cached(dev)
        times = timed[0][0]
        x = times.output
        passes = [a + b for a, b in zip(passes, times.passes)] if passes else times.passes
        if times.loss:
            loss_ms = statistics.median(times.loss)
        for into, (got, _) in zip([layers, twin], timed):
            assert into is not None
            _keep(into[start:end], got)
    if moved > NOISY_SPREAD and warnings is not None:
        warnings.append(f"the host's pace moved between the {rounds} timing rounds: the slowest took {moved:.2f} x "
                        f"the fastest, which the profile keeps (warning above {NOISY_SPREAD}). Where the host sets "
                        "the pace (small microbatches on a GPU), training may run slower than planned")
    return passes, loss_ms


def _keep(stats: list[dict[str, Any]], times: ChainTimes) -> None:
    """Each layer's medians from `times` into its stats; its share of the backward's weight gradients kept."""
    for st, f, b, a in zip(stats, times.forward, times.backward, times.accumulate):
        share = st["backward_weight_ms"] / st["backward_ms"] if st.get("backward_weight_ms") else None
        st["forward_ms"] = statistics.median(f)
        st["backward_ms"] = statistics.median(b)
        st["backward_accumulate_ms"] = statistics.median(a)
        if share is not None:
            st["backward_weight_ms"] = share * st["backward_ms"]
