"""Host time per action (hostwrap's dumps) beside device time (the --trace): per rank, medians and per-step sums,
and the host's time between actions (its own bookkeeping)."""
import json, statistics as st, sys
prefix, trace = sys.argv[1], sys.argv[2]
t = json.load(open(trace)); ev = t["traceEvents"] if isinstance(t, dict) else t
for rank in (0, 1):
    host = json.load(open(f"{prefix}.rank{rank}.json"))
    host = [h for h in host if h[2] >= 4]
    nsteps = len({h[2] for h in host})
    dev = [e for e in ev if e.get("ph") == "X" and e["tid"] == rank and e["args"].get("step", 0) >= 4]
    for k in ("F", "B", "STEP", "WAIT", "SEND"):
        hs = [(b - a) * 1e3 for kind, mb, s, a, b in host if kind.split("_")[0] == k]
        ds = [e["dur"] / 1e3 for e in dev if (e["name"].rstrip("0123456789") or e["name"]).split("_")[0] == k
              or (k in "FB" and e["name"][0] == k and e["name"][1:].isdigit())]
        if hs:
            print(f"rank {rank} {k:4s} n={len(hs)} host med {st.median(hs):.2f} p90 {sorted(hs)[len(hs)*9//10]:.2f} "
                  f"sum/step {sum(hs)/nsteps:.1f} | device med {st.median(ds) if ds else 0:.2f} sum/step {sum(ds)/nsteps:.1f}")
    gaps = [(host[i + 1][3] - host[i][4]) * 1e3 for i in range(len(host) - 1) if host[i + 1][2] == host[i][2]]
    per = {}
    for kind, mb, s, a, b in host:
        per.setdefault(s, [a, b]); per[s][1] = b
    periods = [per[s + 1][0] - per[s][0] for s in sorted(per) if s + 1 in per]
    print(f"rank {rank} host gaps between actions: sum/step {sum(gaps)/nsteps:.1f} ms, med {st.median(gaps):.3f}; "
          f"host period med {st.median(periods)*1e3:.1f} ms")
