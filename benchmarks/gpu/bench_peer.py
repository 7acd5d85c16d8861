"""What a GPU's compute loses while its peer works and a transfer is pending (issue 15).

Two processes, one GPU each: rank 0 times a fixed amount of GPT-block work (forward + backward) under each
condition below, rank 1 does the condition's part. Conditions:

  alone           rank 1 idle
  peer busy       rank 1 runs the same work at the same time
  nccl posted     rank 0 holds a posted NCCL receive the whole time (rank 1 sends after the work); rank 1 idle
  nccl posted+busy  the same, rank 1 working
  nccl stream     rank 1 works in 8 chunks and sends a microbatch's activations after each; rank 0 posted the 8
                  NCCL receives ahead (the pipeline's pattern)
  ce posted+busy  rank 0's side stream waits on a flag (cuStreamWaitValue32) the whole time; rank 1 working
  ce stream       as nccl stream, through pipeflow's copy-engine protocol: rank 1 packs into its own slot and
                  raises rank 0's flag; rank 0's side stream waits for it, pulls the slot over the copy engines
                  and raises rank 1's flag

    python3 benchmarks/gpu/bench_peer.py [--batch 8] [--reps 8] [--trials 5]

Prints one RESULT line per condition (median ms of rank 0's work, and its ratio to "alone")."""
from __future__ import annotations

import argparse
import faulthandler
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from pipeflow import cudadrv  # noqa: E402
from pipeflow.models.gpt import Block  # noqa: E402

CHUNKS = 8


def _worker(rank: int, args: argparse.Namespace) -> None:
    faulthandler.dump_traceback_later(args.deadline, exit=True)  # a hang prints where, then ends the run
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    cpu = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    block = Block(2048, 16).to(dev, torch.bfloat16)
    x = torch.randn(args.batch, 1024, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    msg = torch.randn(args.batch, 1024, 2048, device=dev, dtype=torch.bfloat16)
    nbytes = msg.numel() * msg.element_size()
    bufs = [torch.empty_like(msg) for _ in range(CHUNKS)]
    side = torch.cuda.Stream(dev)

    # the copy-engine protocol's memory: each rank's slot (sender side) and flags, shared both ways
    slot = cudadrv.alloc(nbytes)
    flags = cudadrv.alloc(8, zero=True)  # [0]: "full" (raised by the peer's sender), [1]: "empty" (raised by the peer)
    mine = [cudadrv.ipc_handle(slot), cudadrv.ipc_handle(flags)]
    theirs: list = [None, None]
    dist.all_gather_object(theirs, mine, group=cpu)
    peer_slot, peer_flags = (cudadrv.ipc_open(h) for h in theirs[1 - rank])
    # open the pair's NCCL communicator now: torch creates it at the first send/receive and blocks until the
    # peer's first one, which in a condition below comes only after a barrier
    if rank == 0:
        dist.recv(bufs[0], src=1)
    else:
        dist.send(msg, dst=0)
    counter = [0]  # messages so far on the channel 1 -> 0 (both ranks count them alike)

    def work(reps: int) -> None:
        for _ in range(reps):
            block(x).backward(g)

    def sync() -> None:
        torch.cuda.synchronize(dev)
        dist.barrier(group=cpu)

    def timed(fn) -> float:  # rank 0: fn() enqueues the work; ms on the compute stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def ce_send() -> None:  # rank 1: pack into its slot, raise rank 0's "full"
        counter[0] += 1
        n = counter[0]
        st = torch.cuda.current_stream().cuda_stream
        if n > 1:
            cudadrv.wait_at_least(st, flags + 4, n - 1)  # rank 0 pulled the previous message
        cudadrv.copy(slot, msg.data_ptr(), nbytes, st)
        cudadrv.write(st, peer_flags, n)

    def ce_recv(i: int) -> None:  # rank 0, on the side stream: wait "full", pull, raise rank 1's "empty"
        counter[0] += 1
        n = counter[0]
        st = side.cuda_stream
        cudadrv.wait_at_least(st, flags, n)
        cudadrv.copy(bufs[i].data_ptr(), peer_slot, nbytes, st)
        cudadrv.write(st, peer_flags + 4, n)

    def condition(name: str) -> float | None:
        sync()
        ms = None
        if name == "alone":
            if rank == 0:
                ms = timed(lambda: work(args.reps))
        elif name == "peer busy":
            ms = timed(lambda: work(args.reps)) if rank == 0 else (work(args.reps), None)[1]
        elif name.startswith("nccl posted"):
            if rank == 0:
                w = dist.irecv(bufs[0], src=1)
                ms = timed(lambda: work(args.reps))
            elif name.endswith("busy"):
                work(args.reps)
                torch.cuda.current_stream().synchronize()
            dist.barrier(group=cpu)
            if rank == 1:
                dist.send(msg, dst=0)
            else:
                w.wait()
        elif name == "nccl stream":
            if rank == 0:
                works = [dist.irecv(bufs[i], src=1) for i in range(CHUNKS)]
                ms = timed(lambda: work(args.reps))
                for w in works:
                    w.wait()
            else:
                for _ in range(CHUNKS):
                    work(max(1, args.reps // CHUNKS))
                    dist.send(msg, dst=0)
        elif name == "ce posted+busy":
            if rank == 0:
                counter[0] += 1
                cudadrv.wait_at_least(side.cuda_stream, flags, counter[0])
                ms = timed(lambda: work(args.reps))
            else:
                work(args.reps)
                torch.cuda.current_stream().synchronize()
            dist.barrier(group=cpu)
            if rank == 1:
                counter[0] += 1
                cudadrv.write(torch.cuda.current_stream().cuda_stream, peer_flags, counter[0])
            else:
                cudadrv.write(side.cuda_stream, peer_flags + 4, counter[0])
        elif name == "ce stream":
            if rank == 0:
                for b in bufs:
                    b.zero_()
                torch.cuda.current_stream().synchronize()  # zeroed before the side stream pulls into them
                for i in range(CHUNKS):
                    ce_recv(i)
                ms = timed(lambda: work(args.reps))
            else:
                for _ in range(CHUNKS):
                    work(max(1, args.reps // CHUNKS))
                    ce_send()
        sync()
        return ms

    names = ["alone", "peer busy", "nccl posted", "nccl posted+busy", "nccl stream", "ce posted+busy", "ce stream"]
    for name in names:  # warm every path once
        condition(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.trials):
        for name in names:
            ms = condition(name)
            if ms is not None:
                times[name].append(ms)
                print(f"  {name}: {ms:.2f} ms", flush=True)
    if rank == 0:
        base = statistics.median(times["alone"])
        for name in names:
            med = statistics.median(times[name])
            print(f"RESULT {name:18s} {med:8.2f} ms  {med / base:6.3f}x alone  "
                  f"(trials {', '.join(f'{t:.1f}' for t in times[name])})", flush=True)
        # the last condition pulled rank 1's message into zeroed buffers: equal to it (both ranks seeded alike)
        print(f"RESULT copy-engine messages intact: {all(torch.equal(b, msg) for b in bufs)}", flush=True)
    dist.barrier(group=cpu)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=8, help="block forward+backward passes per timing (default 8)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--deadline", type=float, default=90.0, help="seconds before a hung run prints its stacks")
    args = p.parse_args()
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # no kernel load waiting on a posted receive
    t0 = time.time()
    mp.spawn(_worker, args=(args,), nprocs=2)
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
