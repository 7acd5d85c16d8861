"""(benchmarks/gpu/README.md, 2026-11-27 afternoon; run from the repository root with PYTHONPATH=.) Host and device time of each part of an async STEP on GPT stage 0 (embedding + 13 blocks, d=2048, bf16)."""
import time, torch
from pipeflow.models import gpt
from pipeflow.tensorops import nonfinite_flag, copy_weights
spec = gpt.build(layers=13, d_model=2048, heads=16, seq_len=1024, vocab=32000, dataset="synthetic")
dev = torch.device("cuda")
layers = [l.to(dev, torch.bfloat16) for l in spec.layers[:14]]
params = [p for l in layers for p in l.parameters()]
print(len(params), "params", sum(p.numel() for p in params) / 1e9, "B")
grads = [torch.randn_like(p) for p in params]
for p, g in zip(params, grads): p.grad = g
opt = torch.optim.Adam(params, lr=1e-4, fused=True)
opt.step()
dst = [torch.empty_like(p) for p in params]
ones = {}
def restore():
    for p, g in zip(params, grads): p.grad = g
def flag():
    f = nonfinite_flag(grads, dev, ones)
    fl = torch.stack([f, torch.zeros((), device=dev)])
    opt.found_inf = fl.max()
def t(name, f, n=30):
    f(); torch.cuda.synchronize()
    host = 0.0; e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        t0 = time.perf_counter(); f(); host += time.perf_counter() - t0
    e1.record(); torch.cuda.synchronize()
    print(f"{name:34s} host {host / n * 1e3:7.3f} ms   device {e0.elapsed_time(e1) / n:7.3f} ms", flush=True)
t("optimizer.step (fused Adam)", opt.step)
t("zero_grad + restore grads", lambda: (opt.zero_grad(set_to_none=True), restore()))
t("restore grads", restore)
t("nonfinite flag + stack + max", flag)
t("copy_weights", lambda: copy_weights(dst, params))
t("_foreach_copy_", lambda: torch._foreach_copy_(dst, params))
t("all of it", lambda: (flag(), copy_weights(dst, params), opt.step(), opt.zero_grad(set_to_none=True), restore()))
del opt.found_inf
t("optimizer.step, no found_inf", opt.step)
