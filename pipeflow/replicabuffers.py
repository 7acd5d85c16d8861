"""Buffers a training forward updates in a replicated stage (spectral_norm's `_u`/`_v`, an EMA of activations):
found on the first step by comparing the stage's buffers before and after it, and named in one warning.

Each replica updates its own copy from its own microbatches, so the next forward differs from one process's, and
with it the gradients: unlike BatchNorm in training mode (which normalises by each microbatch's own statistics,
warned at set-up: planning.replicated_statistics), the parameters can train differently too. What changes a buffer
is only known by running the layers: a layer's own code, a parametrization. So the stage's first replica copies its
buffers before its first step and compares them after it (values, not `_version`: a CUDA graph's replay writes a
buffer without counting, and graphs.py's warm-up copies the buffers back in place). Once; BatchNorm's running
statistics are left to their own warning.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("pipeflow")


def watched(engine: Any) -> list[tuple[int, str, str]]:
    """(stage, name in the stage, model-wide name) of the buffers of the replicated stages this rank runs as their
    first replica, BatchNorm's tracked running statistics left out (planning.replicated_statistics warns of them)."""
    if engine.r != 0:
        return []
    out = []
    for k, stage in engine.stages.items():
        if engine.plan.stages[k].replicas < 2:
            continue
        norms = {name for name, m in stage.module.named_modules()
                 if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats}
        for name, _ in stage.module.named_buffers():
            if name.rpartition(".")[0] not in norms:
                idx, _, rest = name.partition(".")
                out.append((k, name, f"{int(idx) + stage.start}.{rest}"))
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and values (NaN where NaN was)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def warning(k: int, layers: tuple[int, int], replicas: int, names: list[str]) -> str:
    """The one line for stage k, whose forward changed the buffers `names` on its first step."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"stage {k} (layers [{layers[0]}, {layers[1]})) runs on {replicas} replicas and its forward updates "
            f"buffers ({shown}): each replica updates its own copy from its share of the microbatches, so the forward "
            f"differs from one process's and so can the parameters, and the saved model and checkpoints keep replica "
            f"0's (plan the stage unreplicated to train as one process)")


class BufferWatch:
    """Around a Pipeline's first training step (step or run_segment): warns on a replicated stage's first replica
    of the buffers that step changed."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.done = False

    @contextlib.contextmanager
    def first_step(self) -> Iterator[None]:
        if self.done:
            yield
            return
        self.done = True
        stages = self.engine.stages
        before = [(k, local, name, stages[k].module.get_buffer(local).detach().clone())
                  for k, local, name in watched(self.engine)]
        yield  # an error in the step leaves it: the run stops anyway
        changed: dict[int, list[str]] = {}
        for k, local, name, copy in before:
            try:
                now = stages[k].module.get_buffer(local)  # the same tensor, or one the forward put in its place
            except AttributeError:  # the forward removed it
                now = None
            if now is None or not same(now, copy):
                changed.setdefault(k, []).append(name)
        for k, names in sorted(changed.items()):
            st = self.engine.plan.stages[k]
            log.warning("%s", warning(k, tuple(st.layers), st.replicas, names))
