"""Where the 2-stage GPT split's stages spend their time at microbatch 4 (one H200): each stage's layers run as a
chain pass after pass (forward, the loss on the last, backward), against the loss timed as pipeflow-profile does."""
import statistics, sys, torch
sys.path.insert(0, ".")
from pipeflow.models import gpt
from partitioner.measure import Timer, time_loss
dev = torch.device("cuda")
spec = gpt.build(layers=24, d_model=2048, heads=16, seq_len=1024, vocab=32000, dataset="synthetic")
mods = [l.to(dev, torch.bfloat16) for l in spec.layers]
b = int(sys.argv[1]) if len(sys.argv) > 1 else 4
x = torch.randint(0, 32000, (b, 1024), device=dev)
y = torch.randint(0, 32000, (b, 1024), device=dev)
with torch.no_grad():
    h = x
    for m in mods[:14]: h = m(h)
h14 = h.detach()
with torch.no_grad():
    for m in mods[14:]: h = m(h)
logits = h.detach()
def passes(fn, k=10):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    a, c = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(k): fn()
    c.record(); c.synchronize()
    return a.elapsed_time(c) / k
def stage0():
    h = x
    for m in mods[:14]: h = m(h)
    h.backward(torch.full_like(h, 1e-3))
def stage1(loss=True):
    h = h14.requires_grad_(True)
    for m in mods[14:]: h = m(h)
    if loss: spec.loss_fn(h, y).backward()
    else: h.backward(torch.full_like(h, 1e-3))
def head_loss(loss=True):
    h = mods[-1](h14.requires_grad_(True))
    if loss: spec.loss_fn(h, y).backward()
    else: h.backward(torch.full_like(h, 1e-3))
lg = logits.clone().requires_grad_(True)
def loss_only(): spec.loss_fn(lg, y).backward()
def loss_fwd_only():
    with torch.no_grad(): spec.loss_fn(lg, y)
r = {"stage0 F+B": passes(stage0), "stage1 F+B+loss": passes(stage1), "stage1 F+B no loss": passes(lambda: stage1(False)),
     "head+loss": passes(head_loss), "head no loss": passes(lambda: head_loss(False)),
     "loss F+B back-to-back": passes(loss_only), "loss F only": passes(loss_fwd_only)}
lg2 = logits.clone()
r["loss as profiled (held)"] = time_loss(spec.loss_fn, lg2.requires_grad_(True), y, Timer(dev, held=True), warmup=2, repeats=5)
r["loss as profiled (idle)"] = time_loss(spec.loss_fn, logits.clone().requires_grad_(True), y, Timer(dev, held=False), warmup=2, repeats=5)
print(f"UB3 b={b}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in r.items()), flush=True)
