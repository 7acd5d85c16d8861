import sys, atexit
from pipeflow import bufpool
stats = {"take": 0}
orig = bufpool.BufferPool.take
pools = []
def take(self, shape, dtype):
    stats["take"] += 1
    if self not in pools: pools.append(self)
    return orig(self, shape, dtype)
bufpool.BufferPool.take = take
atexit.register(lambda: print(f"POOL takes {stats['take']} reused {sum(p.reused for p in pools)}", file=sys.stderr))
from pipeflow.train import main
sys.exit(main(sys.argv[1:]))
