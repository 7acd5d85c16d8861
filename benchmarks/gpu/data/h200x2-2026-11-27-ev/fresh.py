"""Fresh machine, first command: the profiler's chain timing (GPT 24 x 2048, mb 2, bf16) in spaced rounds, with
the host's own pace beside it (a pure-Python loop, tiny-kernel launches) and the load."""
import os, statistics, subprocess, time, torch
from pipeflow.models import gpt
from partitioner.chain import time_chain
from partitioner.layermem import sandbox_copy

def host():
    t = time.perf_counter(); s = 0
    for i in range(1_000_000):
        s += i
    py = (time.perf_counter() - t) * 1e3
    a = torch.zeros(16, device="cuda"); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        a.add_(1)
    launch = (time.perf_counter() - t) / 2000 * 1e6
    torch.cuda.synchronize()
    return py, launch

def load():
    return open("/proc/loadavg").read().split()[:3]

print("uptime", open("/proc/uptime").read().split()[0], "load", load(), "threads", torch.get_num_threads(), flush=True)
spec = gpt.build(layers=24, d_model=2048, heads=16, seq_len=1024, vocab=32000, dataset="synthetic")
dev = torch.device("cuda")
works = [sandbox_copy(l, dev, torch.bfloat16, fuse=False) for l in spec.layers]
x = torch.randint(0, 32000, (2, 1024))
t0 = time.monotonic()
r = 0
while time.monotonic() - t0 < float(os.environ.get("SPAN", "100")):
    py, launch = host()
    t = time_chain(works, x, dev, warmup=2, repeats=5)
    fwd = sum(statistics.median(f) for f in t.forward); bwd = sum(statistics.median(b) for b in t.backward)
    print(f"round {r:2d} at {time.monotonic() - t0:5.1f} s: forward {fwd:6.2f} backward {bwd:6.2f} ms | python loop "
          f"{py:6.1f} ms, launch {launch:5.2f} us | load {' '.join(load())}", flush=True)
    if r in (0, 8):
        top = subprocess.run(["top", "-b", "-n1", "-w", "200"], capture_output=True, text=True).stdout.splitlines()
        print("\n".join(top[:22]), flush=True)
    r += 1
    time.sleep(float(os.environ.get("GAP", "3")))
