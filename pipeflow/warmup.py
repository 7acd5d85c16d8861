"""1F1B's warm-up depths: forwards a stage runs before its first backward (pure)."""
from __future__ import annotations

import math
from collections.abc import Sequence


def warmup_forwards(replicas: Sequence[int], stage: int) -> int:
    """Forwards a stage runs before its first backward in 1F1B: enough to fill the workers downstream.

    With one replica per stage this is S-1-s (DAPPLE / PipeDream-Flush); with replicas it is
    PipeDream's NOAM ceil(workers from s on / replicas of s) minus the one in flight here.
    """
    return max(0, math.ceil(sum(replicas[stage:]) / replicas[stage]) - 1)


def least_warmups(replicas: Sequence[int]) -> list[int]:
    """warmup_forwards of every stage: the schedule's own (DAPPLE's minimum), which pipeflow-plan may deepen."""
    return [warmup_forwards(replicas, s) for s in range(len(replicas))]


def fill_warmup(replicas: Sequence[int], stage: int, *, backward_ratio: float = 2.0) -> int:
    """Forwards that keep a stage busy until its first gradient returns, for stages of equal cost with
    backward = `backward_ratio` x forward: the round trip to the last stage and back takes
    (1 + ratio) x warmup_forwards forward-times. DAPPLE's minimum leaves the first stages idle that
    long once per minibatch; when the first stage is the bottleneck that idle time is lost throughput.
    Costs memory: that many more microbatches' activations in flight."""
    return math.ceil((1 + backward_ratio) * warmup_forwards(replicas, stage))
