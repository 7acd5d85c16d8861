"""Host cost of pipeflow's SplitLinear (gemm accumulation) against native nn.Linear, one GPU, stage 0 of the GPT."""
import statistics, sys, time, faulthandler, cProfile, pstats, io
import torch
from torch import nn
from pipeflow.models import gpt
from pipeflow import split
faulthandler.dump_traceback_later(240, exit=True)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
mb = int(sys.argv[1]) if len(sys.argv) > 1 else 2
blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 13
d = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
seq = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
spec = gpt.build(layers=blocks, d_model=d, heads=16, seq_len=seq, vocab=32000, dataset="synthetic")
stage = nn.Sequential(*spec.layers[:-1]).to(DEV).to(torch.bfloat16)
idx = torch.randint(0, 32000, (mb, seq), device=DEV)
gy = torch.randn(mb, seq, d, device=DEV, dtype=torch.bfloat16)
store = split.WeightGradStore(fuse=True)
def sync():
    if DEV == "cuda": torch.cuda.synchronize()
def mode(m):
    split.uninstall(stage)
    if m == "gemm": split.install(stage, store)
    if m == "fn-nofuse": split.install(stage, split.WeightGradStore(fuse=False))
def once():
    sync(); t0 = time.perf_counter(); y = stage(idx); t1 = time.perf_counter(); sync(); t2 = time.perf_counter()
    y.backward(gy); t3 = time.perf_counter(); sync(); t4 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3, (t3 - t2) * 1e3, (t4 - t2) * 1e3
modes = ["native", "gemm", "fn-nofuse"]
res = {m: [] for m in modes}
for m in modes:
    mode(m); stage.zero_grad(set_to_none=True); once(); once()
for r in range(10):
    for m in modes:
        mode(m); res[m].append(once())
for m in modes:
    cols = list(zip(*res[m]))
    print(f"FNHOST {m:10s} mb={mb}: fwd host {statistics.median(cols[0]):.2f} ms, fwd total {statistics.median(cols[1]):.2f}, bwd host {statistics.median(cols[2]):.2f}, bwd total {statistics.median(cols[3]):.2f}")
LIGHT = "light" in sys.argv
if LIGHT: sys.exit(0)
if DEV == "cuda":
    mode("gemm"); torch.cuda.set_sync_debug_mode("warn")
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always"); once()
    torch.cuda.set_sync_debug_mode(0)
    print(f"FNHOST sync warnings under gemm: {len(w)}", *[str(x.message)[:200] for x in w[:5]], sep="\n  ")
    from torch.profiler import profile, ProfilerActivity
    for m in ("native", "gemm"):
        mode(m); once()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once()
        print(f"=== profiler {m}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
mode("gemm"); once()
pr = cProfile.Profile(); pr.enable()
for _ in range(3): once()
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
