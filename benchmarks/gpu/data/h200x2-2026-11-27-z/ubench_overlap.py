"""Can async's per-update work (check + stash copy + fused Adam) hide under the next F and B on a side stream?
GPT stage 0 (embedding + 13 blocks, bf16) at microbatch b, one H200."""
import statistics, sys, torch
sys.path.insert(0, ".")
from pipeflow.models import gpt
from pipeflow.tensorops import copy_weights, nonfinite_flag
dev = torch.device("cuda")
spec = gpt.build(layers=24, d_model=2048, heads=16, seq_len=1024, vocab=32000, dataset="synthetic")
mods = [l.to(dev, torch.bfloat16) for l in spec.layers[:14]]
params = [[p for p in m.parameters()] for m in mods]
flat = [p for ps in params for p in ps]
# the "live" weights being updated: a separate copy, so F/B's weights are untouched (timing only)
live = [[p.detach().clone() for p in ps] for ps in params]
for ps in live:
    for p in ps: p.grad = torch.randn_like(p) * 1e-3
stash = [[torch.empty_like(p) for p in ps] for ps in live]
opts = [torch.optim.Adam(ps, lr=1e-5, fused=True) for ps in live]
for o in opts: o.step()
allgrads = [p.grad for ps in live for p in ps]
ones = {}
side = torch.cuda.Stream()
def ev(): return torch.cuda.Event(enable_timing=True)
for b in (2, 4):
    x = torch.randint(0, 32000, (b, 1024), device=dev)
    def fwd(waits=None):
        h = x
        for i, m in enumerate(mods):
            if waits is not None: torch.cuda.current_stream().wait_event(waits[i])
            h = m(h)
        return h
    def fb(waits=None):
        out = fwd(waits)
        out.backward(torch.ones_like(out) * 1e-3)
    def update(per_layer_events=None):
        flag = nonfinite_flag(allgrads, dev, ones)
        for i in range(len(mods)):
            copy_weights(stash[i], live[i])
            opts[i].step()
            if per_layer_events is not None: per_layer_events[i].record()
        return flag
    def timed(fn, reps=15):
        for _ in range(3): fn()
        torch.cuda.synchronize(); ts = []
        for _ in range(reps):
            a, c = ev(), ev(); a.record(); fn(); c.record(); c.synchronize(); ts.append(a.elapsed_time(c))
        return statistics.median(ts)
    def serial(): update(); fb(); fb_zero()
    def fb_zero():
        for m in mods: m.zero_grad(set_to_none=True)
    def concurrent_blind():
        start = ev(); start.record(); side.wait_event(start)
        with torch.cuda.stream(side): update()
        fb(); fb_zero()
        torch.cuda.current_stream().wait_stream(side)
    def concurrent_layered():
        start = ev(); start.record(); side.wait_event(start)
        es = [torch.cuda.Event() for _ in mods]
        with torch.cuda.stream(side): update(es)
        fb(es); fb_zero()
        torch.cuda.current_stream().wait_stream(side)
    def fonly(): fwd()
    t_u = timed(update); t_fb = timed(lambda: (fb(), fb_zero())); t_f = timed(fonly)
    t_s = timed(serial); t_cb = timed(concurrent_blind); t_cl = timed(concurrent_layered)
    print(f"UB2 b={b}: update {t_u:.2f} ms, F {t_f:.2f}, F+B {t_fb:.2f}, serial U;F;B {t_s:.2f}, "
          f"U || F+B {t_cb:.2f} (hidden {(t_s - t_cb) / t_u:.0%}), U || F+B layer-waits {t_cl:.2f} "
          f"(hidden {(t_s - t_cl) / t_u:.0%})", flush=True)
