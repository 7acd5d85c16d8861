"""The monitor: span metrics and trace format (pure), then a 4-rank run read back through TensorBoard's own
reader, a live `tensorboard` server's HTTP API, and the Chrome trace."""
from __future__ import annotations

import io
import json
import math
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from pipeflow.monitor import Progress, Span, chrome_trace, step_metrics, window_metrics
from pipeflow.spec import build_model
from tests.conftest import Case, MpiRun, batched

GPT = {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 256}
STEPS, M, B, EVERY = 6, 4, 2, 2
PREDICTED = {"step_ms": 40.0, "samples_per_s": 200.0, "bubble_fraction": 0.43,
             "peak_memory_bytes": [1.0e6, 2.0e6, 3.0e6, 4.0e6]}
STAGE_TAGS = {"time/forward_ms", "time/backward_ms", "time/comm_wait_ms", "time/idle_ms", "time/step_ms",
              "time/optimizer_ms",
              "pipeline/bubble_fraction", "memory/peak_bytes", "predicted/peak_memory_bytes"}
PEAK_TFLOPS = 0.001  # a CPU has no table entry: --peak-tflops gives MFU
MAIN_TAGS = {"throughput/samples_per_s", "throughput/tokens_per_s", "throughput/mfu", "loss/train", "lr",
             "time/step_ms", "pipeline/bubble_fraction", "predicted/step_ms", "predicted/samples_per_s",
             "predicted/bubble_fraction"}


# ---------------------------------------------------------------- pure


def test_step_metrics_split_the_step_into_compute_wait_and_idle():
    spans = [Span("WAIT_F", 0, 0, 0.000, 0.002), Span("F", 0, 0, 0.002, 0.005), Span("SEND_F", 0, 0, 0.005, 0.006),
             Span("WAIT_B", 0, 0, 0.006, 0.007), Span("B", 0, 0, 0.007, 0.013), Span("STEP", None, 0, 0.013, 0.014)]
    got = step_metrics(spans, 0.0, 0.020)
    assert got["time/forward_ms"] == pytest.approx(3.0)
    assert got["time/backward_ms"] == pytest.approx(6.0)
    assert got["time/comm_wait_ms"] == pytest.approx(3.0)
    assert got["time/optimizer_ms"] == pytest.approx(1.0)
    assert got["time/idle_ms"] == pytest.approx(20.0 - 9.0 - 3.0)
    assert got["pipeline/bubble_fraction"] == pytest.approx(1 - 9.0 / 20.0)
    # Two steps in a window: the mean.
    later = [Span("F", 1, 1, 0.020, 0.030)]
    mean = window_metrics(spans + later, [(0, 0.0, 0.020), (1, 0.020, 0.040)])
    assert mean["time/forward_ms"] == pytest.approx((3.0 + 10.0) / 2)
    assert window_metrics([], []) == {}


def test_chrome_trace_has_one_named_row_per_rank():
    trace = chrome_trace([(1, 1, [Span("B", 3, 0, 0.5, 0.75)]), (0, 0, [Span("F", 3, 0, 0.0, 0.25)])])
    json.dumps(trace)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "rank 0 (stage 0)", 1: "rank 1 (stage 1)"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in spans] == [("F3", 0, 0.0, 250000.0),
                                                                        ("B3", 1, 500000.0, 250000.0)]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_live_bar_on_a_terminal():
    out = _Terminal()
    p = Progress(4, samples_per_step=8, tokens_per_sample=64, stream=out)
    assert p.update(2, 3.25) > 0
    p.update(4, 2.5)
    text = out.getvalue()
    assert text.startswith("\r[############............] 2/4 | loss 3.2500 | ")
    assert "samples/s" in text and "k tok/s" in text and text.endswith("\n")


def test_progress_shows_the_clipped_gradients_norm():
    out = _Terminal()
    Progress(4, samples_per_step=8, stream=out).update(1, 3.25, 1.23456)
    assert out.getvalue().startswith("\r[######..................] 1/4 | loss 3.2500  grad norm 1.235 | ")


# ---------------------------------------------------------------- a real run


def monitored(d: Path) -> Case:
    """One 1f1b run of a tiny GPT on 4 ranks (a stage each) with a plan that carries predictions; the
    tests below share it."""
    plan = {"format": "pipeflow.plan/1", "schedule": "1f1b", "microbatches": M, "workers": 4,
            "stages": [{"layers": [i, i + 1], "replicas": 1, "ranks": [i]} for i in range(4)],
            "predicted": PREDICTED}
    (d / "plan.json").write_text(json.dumps(plan))
    return Case(4, ["--model", "gpt", "--model-args", json.dumps(GPT), "--plan", str(d / "plan.json"),
                    "--steps", str(STEPS), "--microbatch-size", str(B), "--log-every", str(EVERY), "--device", "cpu",
                    "--tensorboard", str(d / "tb"), "--trace", str(d / "trace.json"),
                    "--peak-tflops", str(PEAK_TFLOPS)], env={"PIPEFLOW_LOG": "INFO"}, timeout=150)


@pytest.fixture
def run(mpi: MpiRun) -> Path:
    return mpi.dir


@batched(monitored)
def test_steady_state_line_gives_mfu_per_device(mpi: MpiRun):
    """The owner's steady-state line: samples/s, tokens/s and MFU per device against --peak-tflops."""
    import re

    line = next(ln for ln in mpi.proc.stderr.splitlines() if "steady state" in ln)
    got = re.search(r": ([0-9.]+) samples/s, [0-9]+ tokens/s, MFU ([0-9.]+)% per GPU \(0.001 TFLOP/s peak\)$", line)
    assert got, line
    n = sum(p.numel() for m in build_model("gpt", GPT).layers[1:] for p in m.parameters())
    flops = 6 * n * GPT["seq_len"] + 12 * GPT["layers"] * GPT["d_model"] * GPT["seq_len"] ** 2
    assert float(got.group(2)) == pytest.approx(100 * float(got.group(1)) * flops / (4 * PEAK_TFLOPS * 1e12),
                                                abs=0.06)


def _scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@batched(monitored)
def test_event_files_hold_every_tag_at_every_report(run):
    reports = list(range(EVERY, STEPS + 1, EVERY))
    main = _scalars(run / "tb")
    assert set(main) == MAIN_TAGS
    for tag, points in main.items():
        assert [s for s, _ in points] == reports, tag
    values = {tag: [v for _, v in points] for tag, points in main.items()}
    assert all(v > 0 for v in values["throughput/samples_per_s"])
    assert values["throughput/tokens_per_s"] == pytest.approx([v * GPT["seq_len"]
                                                               for v in values["throughput/samples_per_s"]])
    # MFU per device: the model's FLOP/s over 4 ranks' peak; GPT's FLOPs per sequence by PaLM's formula
    n = sum(p.numel() for m in build_model("gpt", GPT).layers[1:] for p in m.parameters())
    flops = 6 * n * GPT["seq_len"] + 12 * GPT["layers"] * GPT["d_model"] * GPT["seq_len"] ** 2
    assert values["throughput/mfu"] == pytest.approx([v * flops / (4 * PEAK_TFLOPS * 1e12)
                                                      for v in values["throughput/samples_per_s"]], rel=1e-5)
    assert all(math.isfinite(v) and 0 < v < 10 for v in values["loss/train"])
    assert values["lr"] == pytest.approx([1e-3] * len(reports))
    assert values["predicted/bubble_fraction"] == pytest.approx([0.43] * len(reports))
    bubbles = []
    for s in range(4):
        stage = _scalars(run / "tb" / f"stage{s}")
        assert set(stage) == STAGE_TAGS, s
        for tag, points in stage.items():
            assert [step for step, _ in points] == reports, (s, tag)
        v = {tag: [x for _, x in points] for tag, points in stage.items()}
        assert all(0 <= b <= 1 for b in v["pipeline/bubble_fraction"])
        assert all(f > 0 for f in v["time/forward_ms"]) and all(b > 0 for b in v["time/backward_ms"])
        for i in range(len(reports)):
            parts = sum(v[t][i] for t in ("time/forward_ms", "time/backward_ms", "time/comm_wait_ms", "time/idle_ms"))
            assert parts == pytest.approx(v["time/step_ms"][i], rel=1e-3), (s, i)
        assert all(m > 1e6 for m in v["memory/peak_bytes"])  # a Python process with torch: well over 1 MB
        assert v["predicted/peak_memory_bytes"] == pytest.approx([PREDICTED["peak_memory_bytes"][s]] * len(reports))
        bubbles.append(v["pipeline/bubble_fraction"])
    # The run-wide bubble is the mean over stages.
    assert values["pipeline/bubble_fraction"] == pytest.approx([sum(b[i] for b in bubbles) / 4
                                                                for i in range(len(reports))], rel=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@batched(monitored)
def test_tensorboard_serves_the_scalars(run):
    port = _free_port()
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(run / "tb"),
                               "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false",
                               "--reload_interval", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        tags: object = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the server starts, then loads the runs in the background
            try:
                tags = _get(f"{base}/tags")
                if isinstance(tags, dict) and {".", "stage0", "stage3"} <= set(tags):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert server.poll() is None, f"tensorboard exited {server.returncode}"
            time.sleep(0.5)
        assert isinstance(tags, dict) and set(tags) == {".", "stage0", "stage1", "stage2", "stage3"}, tags
        assert set(tags["."]) == MAIN_TAGS and set(tags["stage2"]) == STAGE_TAGS
        q = urllib.parse.urlencode({"run": ".", "tag": "throughput/samples_per_s"})
        points = _get(f"{base}/scalars?{q}")  # [[wall_time, step, value], ...]
        assert isinstance(points, list) and [p[1] for p in points] == list(range(EVERY, STEPS + 1, EVERY))
        assert all(p[2] > 0 for p in points)
        q = urllib.parse.urlencode({"run": "stage1", "tag": "pipeline/bubble_fraction"})
        points = _get(f"{base}/scalars?{q}")
        assert isinstance(points, list) and points and all(0 <= p[2] <= 1 for p in points)
    finally:
        server.terminate()
        try:
            server.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate(timeout=10)


@batched(monitored)
def test_trace_has_every_action_of_every_rank_without_overlap(run):
    trace = json.loads((run / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {r: f"rank {r} (stage {r})" for r in range(4)}
    for rank in range(4):
        mine = sorted((e for e in events if e["ph"] == "X" and e["tid"] == rank), key=lambda e: e["ts"])
        # One host thread and one stream per rank: no two spans overlap (1 µs slack for rounding).
        for a, b in zip(mine, mine[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1, (rank, a, b)
        counts = Counter((e["args"]["step"], e["name"][0]) for e in mine if e["cat"] == "compute")
        assert counts == {(k, kind): M for k in range(STEPS) for kind in "FB"}, rank
        fwd = sorted(e["args"]["microbatch"] for e in mine if e["name"].startswith("F"))
        assert fwd == sorted(list(range(M)) * STEPS)
        assert sum(e["name"] == "STEP" for e in mine) == STEPS
    # Clocks line up: F of a microbatch on stage s+1 starts after it ended on stage s (it needs its output),
    # and B the other way round. Ranks sharing cores leave a barrier milliseconds apart, so this needs more.
    span = {(e["tid"], e["name"], e["args"]["step"]): e for e in events if e.get("cat") == "compute"}
    for (rank, name, step), e in span.items():
        after = span.get((rank + 1 if name[0] == "F" else rank - 1, name, step))
        if after is not None:
            assert e["ts"] + e["dur"] <= after["ts"] + 1, (e, after)
