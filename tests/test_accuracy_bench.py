"""benchmarks/planner/accuracy.py keeps one calibration reading whole (issue 13): its numbers are fitted
together, and each number's own median over readings can fall below every reading's cost."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "planner"))

from accuracy import pick_reading  # noqa: E402


def test_the_fastest_run_s_reading_is_kept():
    assert pick_reading([47.03, 44.97, 48.19], "fastest") == 1


def test_the_median_run_s_reading_is_kept():
    assert pick_reading([47.03, 44.97, 48.19], "median") == 0
    assert pick_reading([40.0, 30.0, 20.0, 10.0], "median") == 2  # the lower middle of an even count


def test_the_kept_reading_is_one_run_s_not_a_mix():
    """2026-12-04's readings of (action_ms, layer_ms): (0.162, 0), (0, 0.028), (0, 0.0). Each field's median,
    (0, 0), would price no runtime cost per action or layer at all, below two of the three fits; the reading kept
    is one run's fit, whole."""
    readings = [{"action_ms": 0.162, "layer_ms": 0.0}, {"action_ms": 0.0, "layer_ms": 0.028},
                {"action_ms": 0.0, "layer_ms": 0.0}]
    stepped = [45.0, 46.0, 47.0]
    assert readings[pick_reading(stepped, "fastest")] == {"action_ms": 0.162, "layer_ms": 0.0}
    assert readings[pick_reading(stepped, "median")] == {"action_ms": 0.0, "layer_ms": 0.028}
