"""HOSTWRAP=1: time each Stage.forward / Stage.backward on the host (perf_counter), print medians per rank at exit."""
import os
if os.environ.get("HOSTWRAP") == "1":
    import atexit, statistics, sys, time
    import torch
    from pipeflow import stage as _stage
    _times = {"forward": [], "backward": []}
    def _wrap(name):
        orig = getattr(_stage.Stage, name)
        def timed(self, *a, **k):
            t = time.perf_counter()
            try:
                return orig(self, *a, **k)
            finally:
                _times[name].append((time.perf_counter() - t) * 1e3)
        setattr(_stage.Stage, name, timed)
    _wrap("forward"); _wrap("backward")
    def _report():
        rank = os.environ.get("PMI_RANK", "?")
        tag = os.environ.get("HOSTWRAP_TAG", "")
        parts = []
        for k, v in _times.items():
            v = v[len(v) // 3:]
            if v:
                parts.append(f"{k} {len(v)} calls median {statistics.median(v):.2f} ms p90 {sorted(v)[int(len(v) * .9)]:.2f} sum {sum(v):.0f}")
        print(f"HOSTWRAP {tag} rank {rank}: " + "; ".join(parts), file=sys.stderr, flush=True)
    atexit.register(_report)
