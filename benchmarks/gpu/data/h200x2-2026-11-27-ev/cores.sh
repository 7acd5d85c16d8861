# per-core host pace, pinned runs, hydra's binding
cat > /tmp/loop.py <<'P'
import time
r=[]
for _ in range(5):
    t=time.perf_counter(); s=0
    for i in range(1_000_000): s+=i
    r.append((time.perf_counter()-t)*1e3)
r.sort(); print(f"min {r[0]:5.1f} med {r[2]:5.1f} max {r[4]:5.1f}")
P
lscpu | grep -iE 'socket|numa|thread|core|model name|mhz' 
for c in $(seq 0 31); do echo -n "cpu $c: "; taskset -c $c python3 /tmp/loop.py; done
echo "unpinned x8:"; for i in 1 2 3 4 5 6 7 8; do python3 /tmp/loop.py; done
echo "hydra binding:"; mpirun -np 2 grep Cpus_allowed_list /proc/self/status
echo "=== fresh.py pinned to cpu 3"; SPAN=25 GAP=1 taskset -c 3 python3 .dev/fresh.py 2>&1 | grep round
echo "=== fresh.py unpinned"; SPAN=25 GAP=1 python3 .dev/fresh.py 2>&1 | grep round
