"""Update pieces on one GPU: fused Adam step, the guard's non-finite check (and alternatives), a weight copy,
on GPT stage 0's parameters (bf16: embedding + 13 blocks) and on a 256 MiB sample of them. From the repository
root on a CUDA machine: python3 benchmarks/gpu/data/h200x2-2026-11-27-y/ubench.py"""
import statistics, sys, torch
sys.path.insert(0, ".")
from pipeflow.models import gpt
from pipeflow.tensorops import copy_weights, nonfinite_flag
dev = torch.device("cuda")
spec = gpt.build(layers=24, d_model=2048, heads=16, seq_len=1024, vocab=32000, dataset="synthetic")
layers = spec.layers[:14]
full = [p.detach().to(dev, torch.bfloat16).clone().requires_grad_(True) for l in layers for p in l.parameters()]
def sample(ps, limit):
    out, n = [], 0
    for p in ps:
        if n >= limit: break
        out.append(p); n += p.numel() * 2
    return out
def ms(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
for name, ps in (("sample 256 MiB", sample(full, 256 * 2**20)), ("stage 0", full)):
    nb = sum(p.numel() * 2 for p in ps)
    for p in ps: p.grad = torch.randn_like(p)
    grads = [p.grad for p in ps]
    opt = torch.optim.Adam(ps, lr=1e-4, fused=True); opt.step()
    dst = [torch.empty_like(p) for p in ps]
    ones = {}
    r = {"adam": ms(opt.step), "check": ms(lambda: nonfinite_flag(grads, dev, ones)),
         "check+adam": ms(lambda: (nonfinite_flag(grads, dev, ones), opt.step())),
         "copy foreach": ms(lambda: torch._foreach_copy_(dst, ps)),
         "copy loop": ms(lambda: [d.copy_(p) for d, p in zip(dst, ps)]),
         "copy_weights": ms(lambda: copy_weights(dst, ps)),
         "norm inf only": ms(lambda: torch._foreach_norm(grads, float("inf"))),
         "norm 2 only": ms(lambda: torch._foreach_norm(grads, 2)),
         "amp check on fp32 view": None}
    print(f"UB {name}: {nb / 2**20:.0f} MiB, {len(ps)} tensors: " + ", ".join(f"{k} {v:.3f} ms" for k, v in r.items() if v is not None), flush=True)
