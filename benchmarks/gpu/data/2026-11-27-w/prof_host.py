"""cProfile each rank of a pipeflow-train run: python .dev/prof_host.py OUTPREFIX -- train args; prints top functions."""
import cProfile, io, os, pstats, sys
sys.path.insert(0, ".")
from pipeflow import train
out = sys.argv[1]
args = sys.argv[3:]
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
print(f"PROF rank {rank} affinity {len(os.sched_getaffinity(0))} cores", flush=True)
pr = cProfile.Profile()
pr.enable()
try:
    train.main(args)
finally:
    pr.disable()
    pr.dump_stats(f"{out}-{rank}.prof")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(f"PROF rank {rank} {os.environ.get('PROF_TAG', '')}\n" + "\n".join(l for l in s.getvalue().splitlines() if l.strip())[:5000], flush=True)
