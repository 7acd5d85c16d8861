"""pipeflow-profile's price of an update (partitioner/measure.py, optimizer_ms_per_byte): what one timed call costs
beyond its updates (the first launch from an idle device, the final sync) is not charged per byte."""
from __future__ import annotations

import pytest
import torch

from partitioner import measure

LATENCY, PER_UPDATE = 1.0, 0.5  # ms: a timing's fixed cost, and one update's


def test_a_timing_s_fixed_cost_is_shared_by_back_to_back_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = [0]
    real = torch.optim.Adam.step

    def counted(self, *a, **k):  # type: ignore[no-untyped-def]
        steps[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", counted)

    def timer(fn) -> float:  # type: ignore[no-untyped-def]
        before = steps[0]
        fn()
        return LATENCY + PER_UPDATE * (steps[0] - before)

    params = [torch.zeros(256), torch.zeros(768)]
    rates = measure.optimizer_ms_per_byte("adam", params, timer, warmup=1, repeats=3)
    assert rates is not None
    per_update = rates[0] * 1024 * 4
    assert measure.UPDATES >= 4
    # One update timed alone would be priced LATENCY + PER_UPDATE = 1.5 ms, three times its own cost.
    assert per_update == pytest.approx(PER_UPDATE + LATENCY / measure.UPDATES)

