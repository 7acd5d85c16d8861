"""The side-by-side GPT benchmark on N GPUs of one host (issues 15 and 16), one row per system, in one call.

    python3 benchmarks/gpu/bench.py --gpus 2                         # the default rows below, on 2 GPUs
    python3 benchmarks/gpu/bench.py --gpus 4 --rows "ddp 8; pf 1f1b 4 16 plan; big 1f1b 1 64 plan"
    python3 benchmarks/gpu/bench.py --cpu                            # tiny GPT, gloo, 2 ranks: checks the harness

Rows (';'-separated), every one at --sequences per optimizer step (default 64):
    single MB                       one GPU, plain training loop (bench_ddp.py on one rank), microbatches of MB
    singles MB                      that loop on every GPU at once, independent processes: the sum of their tokens/s
    ddp MB                          torch DDP on every GPU (bench_ddp.py), MB-sequence microbatches per rank
    torch SCHEDULE MB [SPLIT]       torch.distributed.pipelining (bench_torch_pp.py), m = sequences / MB; SCHEDULE
                                    1F1B, GPipe, Interleaved1F1B or InterleavedZeroBubble (2 stages per rank)
    pf SCHEDULE MB M SPLIT          pipeflow-train; SPLIT: layer counts (14,12), "plan" (pipeflow-plan on a
                                    profile made in this call) or "spot" (planned on the spot by pipeflow-train)
    big SCHEDULE MB M SPLIT         the same with the large model (--big-args), the one DDP cannot run
    ... SPLIT sub                   pf/big rows: the GPT with granularity "sublayer" (attention and MLP as
                                    separate layers, so the plan may cut inside a block); `fine`: granularity
                                    "fine" (four layers a block, cut at its linear layers)
    ... plan shard                  pf/big rows: pipeflow-plan --shard-optimizer (replicated stages split their
                                    optimizer state over the replicas; the plan says so and pipeflow-train follows)
    ... plan mem=GIB                pf/big/gb rows: pipeflow-plan under --memory-per-worker GIB GiB (e.g. torch's
                                    peak, for "as fast at no more memory") instead of 90% of the card's memory
    ... p2p=nccl|ce|auto            pf/big rows: PIPEFLOW_P2P for the row (how stages send: NCCL kernels or the
                                    GPUs' copy engines; default auto, the copy engines where GPUs are peers)
    ... accum=gemm|autograd         pf/big rows: PIPEFLOW_GRAD_ACCUM for the row and its profile (weight gradients
                                    added into .grad by autograd, the default, as in plain PyTorch, or by the GEMM)
    ... flat                        pf/big rows: PIPEFLOW_REDUCE_INPLACE above every tensor (the replicas' all-reduce
                                    through flat buckets only, as before the in-place all-reduce)
    ... env:NAME=VALUE              pf/big rows: the environment variable set for pipeflow-train (any number of them,
                                    e.g. env:PIPEFLOW_REDUCE_LATE=0 env:NCCL_MAX_NCHANNELS=2)
    ... clip=MAX                    pf/big rows: pipeflow-train --clip-grad-norm MAX
    ... card=GIB                    pf/big rows: each rank held to GIB GiB of its GPU (benchmarks/gpu/card.py: 79.1
                                    for an 80 GB H100 on a bigger card); the row shows the peak in use per rank
    ... busy                        pf/big rows: profiled with pipeflow-profile --ranks-per-host N (how much a
                                    companion running the model on every other GPU slows the passes: contention)
    ... trace                       pf/big rows: pipeflow-train --trace, then per rank the ms per step in each
                                    kind of span (F, B, W, STEP, SEND, WAIT) and idle, from the trace
    ... idle|kernels|stage|graphs   pf/big/gb rows: profiled with pipeflow-profile --timing idle (each call from
                                    an idle device), kernels (the kernels back to back) or stage (each layer
                                    inside the chain's forward and backward, as a stage runs them) instead of
                                    the profiler's default for the device (stage on CUDA, idle on CPU); graphs:
                                    the chain with each pass queued first, and pipeflow-train with
                                    PIPEFLOW_CUDA_GRAPHS=1 (gpipe and 1f1b replayed as CUDA graphs)
    ... cal                         pf/big rows on a profiled split: traced as above, then the runtime's costs
                                    read from the trace (python -m partitioner.calibrate); every later row's plan
                                    is priced again with them ("calibrated ms"; this row's own is circular);
                                    a second cal row is read with the first (e.g. at another microbatch size:
                                    then a compute factor is told from the cost per action)
    gb SCHEDULE SIZES [sub|fine] [idle|kernels|stage|graphs] [mem=GIB]
                                    pipeflow-plan --global-batch (the sequences): profiled at microbatch sizes
                                    SIZES (2,4,8), the planner picks b, m and the split; pipeflow-train runs it
Each row prints `RESULT ...` with tokens/s, peak GiB per rank, MFU per GPU and, where a plan gives it, the
predicted step time; $OUT/results.md (or --out) gets the markdown table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from partitioner.profile import CALIBRATED  # noqa: E402
from pipeflow.mfu import PEAK_TFLOPS  # noqa: E402
from pipeflow.planning import GPU_SHARE  # noqa: E402  (as planning on the spot: spot and plan rows alike)
from pipeflow.spec import build_model  # noqa: E402

GPT = {"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000, "dataset": "synthetic"}
# >= 10B parameters: 50 blocks of 12 d^2 = 201M each, plus 2 x 32000 x 4096 embedding and head: 10.3B
# (benchmarks/gpu/README.md, "The large model", for the memory arithmetic).
BIG = {"layers": 50, "d_model": 4096, "heads": 32, "seq_len": 1024, "vocab": 32000, "dataset": "synthetic"}
TINY = {"layers": 4, "d_model": 32, "heads": 2, "seq_len": 16, "vocab": 256, "dataset": "synthetic"}
P2P_WORDS = ("p2p=auto", "p2p=nccl", "p2p=ce")  # a pf/big row's PIPEFLOW_P2P
ACCUM_WORDS = ("accum=gemm", "accum=autograd")  # a pf/big row's PIPEFLOW_GRAD_ACCUM
FLAT = str(10**12)  # a `flat` row's PIPEFLOW_REDUCE_INPLACE: above every tensor, so no gradient is reduced in place
TIMED = ("idle", "kernels", "stage", "graphs")  # a pf/big/gb row's pipeflow-profile --timing (else its default)


def _timing(words: list[str]) -> str:
    return next((w for w in words if w in TIMED), "default")


GRAINS = {"sub": "sublayer", "fine": "fine"}  # a pf/big/gb row's word for the GPT's granularity (else "block")


def _grain(words: list[str]) -> str | None:
    return next((w for w in words if w in GRAINS), None)


DEFAULT_ROWS = ("single 8; ddp 8; torch 1F1B 8; torch 1F1B 4; torch 1F1B 2; torch Interleaved1F1B 2; "
                "torch InterleavedZeroBubble 2; pf 1f1b 8 8 plan; pf 1f1b 4 16 plan; pf 1f1b 2 32 plan; "
                "pf 1f1b 8 8 plan sub; pf 1f1b 4 16 plan sub; pf 1f1b 2 32 spot; pf 2bw 8 8 plan; "
                "pf async 2 32 plan; pf async 8 8 plan")
CPU_ROWS = "single 2; ddp 2; torch 1F1B 2; pf 1f1b 2 4 plan sub; pf async 2 4 spot"  # 8 sequences per step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="tiny GPT on CPU ranks (gloo, float32): checks the harness")
    p.add_argument("--rows", default=None, help=f"default (GPU): {DEFAULT_ROWS!r}")
    p.add_argument("--sequences", type=int, default=None,
                   help="sequences per optimizer step, every row (default 64; --cpu: 8); pf rows: MB x M")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--model-args", default=None, help="the GPT of every row but 'big' (JSON)")
    p.add_argument("--big-args", default=json.dumps(BIG), help="the GPT of the 'big' rows (JSON)")
    p.add_argument("--peak-tflops", type=float, default=None, help="per GPU (default: pipeflow.mfu's table)")
    p.add_argument("--topology", default=None, help="for pipeflow-plan (default: GPUSx300GB/s, NVLink)")
    p.add_argument("--out", default=None, help="results.md here (default: $OUT/results.md, else ./results.md)")
    p.add_argument("--timeout", type=int, default=420, help="seconds per row")
    p.add_argument("--work", default=None, help="logs, profiles and plans here (default: $OUT/bench, else "
                   "./bench); a profile already there is reused, so calls on one machine can share them")
    return p.parse_args(argv)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        args.sequences = args.sequences or (8 if args.cpu else 64)
        self.n = 2 if args.cpu else args.gpus
        self.device, self.dtype = ("cpu", "float32") if args.cpu else ("cuda", "bfloat16")
        self.gpt = json.loads(args.model_args) if args.model_args else (TINY if args.cpu else GPT)
        self.big = json.loads(args.big_args)
        self.work = Path(args.work) if args.work else Path(os.environ.get("OUT") or ".") / "bench"
        self.work.mkdir(parents=True, exist_ok=True)
        self.peak, self.card = self._peak()
        self.rows: list[dict[str, str]] = []
        # the runtime's costs read from a traced row ('cal'), for later rows profiled the same way (by --timing)
        self.cal: dict[str, dict[str, float]] = {}
        self.cal_runs: dict[str, list[tuple[Path, Path, Path]]] = {}  # the traced runs behind it, read together
        self._flops: dict[str, float] = {}
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PIPEFLOW_LOG": "INFO",
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if args.cpu else "8")}

    def _peak(self) -> tuple[float | None, str]:
        if self.a.cpu:
            return self.a.peak_tflops, "CPU"
        import torch

        name = torch.cuda.get_device_name(0)
        if self.a.peak_tflops is not None:
            return self.a.peak_tflops, name
        return next((half for key, half, _ in PEAK_TFLOPS if key in name), None), name

    # ------------------------------------------------------------ running
    def sh(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env={**self.env, **(env or {})}, capture_output=True, text=True,
                                  timeout=self.a.timeout)
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = f"{e.stdout or ''}{e.stderr or ''}\nTIMEOUT after {self.a.timeout} s", 124
        log.write_text(f"$ {shlex.join(cmd)}\n# {time.time() - t0:.1f} s, rc {rc}\n{out}")
        return rc, out

    def torchrun(self, script: str, nproc: int, extra: list[str], log: Path) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(ROOT / "benchmarks/gpu" / script), "--device", self.device, "--dtype", self.dtype,
               "--steps", str(self.a.steps), *extra]
        return self.sh(cmd, log)

    def model_flops(self, cfg: dict[str, object]) -> float:
        """FLOPs per sequence from the model spec, built on the meta device (no memory: the large model is 10 B)."""
        key = json.dumps(cfg, sort_keys=True)
        if key not in self._flops:
            import torch

            with torch.device("meta"):
                spec = build_model("gpt", cfg)
            self._flops[key] = float(spec.flops_per_sample or 0.0)
        return self._flops[key]

    def add(self, name: str, config: str, gpus: int, rc: int, out: str, cfg: dict[str, object],
            predicted: float | None = None, tokens: float | None = None, peak: str | None = None,
            sequences: int | None = None, calibrated: float | None = None) -> None:
        if tokens is None:
            m = (re.search(r"RESULT .*tokens_per_s=([0-9.]+)", out)
                 or re.search(r"steady state.* ([0-9.]+) tokens/s", out))
            tokens = float(m.group(1)) if m else None
            if tokens is not None and rc != 0:  # measured, then failed at teardown (gloo's, seen on CPU): say so
                config += f" [exit {rc} after its result]"
        if peak is None:
            m = re.search(r"peak_gib=([0-9.]+)", out)
            peak = m.group(1) if m else "-"
        mfu = (tokens / int(cfg["seq_len"]) * self.model_flops(cfg) / (gpus * self.peak * 1e12)
               if tokens and self.peak else None)
        seqs = sequences or self.a.sequences
        measured = 1e3 * seqs * int(cfg["seq_len"]) / tokens if tokens else None
        row = {"run": name, "config": config, "tokens/s": f"{tokens:.0f}" if tokens else f"FAILED (rc {rc})",
               "peak GiB/rank": peak, "MFU/GPU": f"{100 * mfu:.1f}%" if mfu is not None else "-",
               "step ms": f"{measured:.1f}" if measured else "-",
               "predicted ms": f"{predicted:.1f}" if predicted else "-",
               "calibrated ms": f"{calibrated:.1f}" if calibrated else "-"}
        self.rows.append(row)
        print("RESULT " + " ".join(f"{k.replace(' ', '_')}={v.replace(' ', '_')}" for k, v in row.items()), flush=True)
        if rc != 0:
            tail = [ln for ln in out.splitlines() if ln.strip()][-3:]
            print("  " + "\n  ".join(tail), flush=True)

    # ------------------------------------------------------------ rows
    def single(self, mb: int) -> None:
        log = self.work / f"single-{mb}.log"
        cmd = [sys.executable, str(ROOT / "benchmarks/gpu/bench_ddp.py"), "--device", self.device, "--dtype",
               self.dtype, "--steps", str(self.a.steps), "--microbatch-size", str(mb), "--sequences",
               str(self.a.sequences), "--model-args", json.dumps(self.gpt)]
        rc, out = self.sh(cmd, log)
        self.add("1 GPU", f"{mb} x {self.a.sequences // mb}", 1, rc, out, self.gpt)

    def singles(self, mb: int) -> None:
        """The 1-GPU loop on every GPU at once, independent processes (no communication): what the GPUs reach
        while all of them work, the ceiling for any method on this machine (2 x `single` assumes none slows
        another). Reports the sum of their tokens/s."""
        cmd = [sys.executable, str(ROOT / "benchmarks/gpu/bench_ddp.py"), "--device", self.device, "--dtype",
               self.dtype, "--steps", str(self.a.steps), "--microbatch-size", str(mb), "--sequences",
               str(self.a.sequences), "--model-args", json.dumps(self.gpt)]
        procs = [subprocess.Popen(cmd, cwd=ROOT, env={**self.env, "CUDA_VISIBLE_DEVICES": str(i)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(self.n)]
        outs = []
        for p in procs:
            try:
                outs.append((p.communicate(timeout=self.a.timeout)[0], p.returncode))
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append((p.communicate()[0] + f"\nTIMEOUT after {self.a.timeout} s", 124))
        (self.work / f"singles-{mb}.log").write_text("\n".join(f"# GPU {i}, rc {rc}\n{out}"
                                                              for i, (out, rc) in enumerate(outs)))
        found = [re.search(r"RESULT .*tokens_per_s=([0-9.]+)", out) for out, _ in outs]
        each = [float(m.group(1)) for m in found if m]
        rc = next((rc for _, rc in outs if rc), 0)
        self.add(f"{self.n} x 1 GPU at once", f"{mb} x {self.a.sequences // mb} on each GPU "
                 f"({', '.join(f'{t:.0f}' for t in each)})", self.n, rc, "", self.gpt,
                 tokens=sum(each) if len(each) == self.n else None)

    def ddp(self, mb: int) -> None:
        rc, out = self.torchrun("bench_ddp.py", self.n, ["--microbatch-size", str(mb), "--sequences",
                                                        str(self.a.sequences), "--model-args", json.dumps(self.gpt)],
                                self.work / f"ddp-{mb}.log")
        self.add(f"DDP x{self.n}", f"{mb} per microbatch, {self.a.sequences // self.n} per rank", self.n, rc, out,
                 self.gpt)

    def torch(self, schedule: str, mb: int, split: str | None = None) -> None:
        stages = self.n * (1 if schedule in ("1F1B", "GPipe") else 2)
        split = split or ",".join(map(str, even_split(int(self.gpt["layers"]), stages)))
        m = self.a.sequences // mb
        rc, out = self.torchrun("bench_torch_pp.py", self.n, ["--schedule", schedule, "--split", split,
                                                             "--microbatches", str(m), "--microbatch-size", str(mb),
                                                             "--model-args", json.dumps(self.gpt)],
                                self.work / f"torch-{schedule}-{mb}.log")
        self.add(f"torch {schedule}", f"{mb} x {m}, layers {split}", self.n, rc, out, self.gpt)

    def profile(self, cfg: dict[str, object], mb: int, tag: str, sizes: str | None = None,
                timing: str = "default", accum: str | None = None, busy: bool = False) -> Path | None:
        """profile.json at microbatch mb, or at every size of `sizes` (one file, for --global-batch), timed by
        pipeflow-profile --timing `timing` ("default": the profiler's own choice for the device), accumulating
        gradients as PIPEFLOW_GRAD_ACCUM=`accum` says (None: the default)."""
        at = ["--microbatch-sizes", sizes] if sizes else ["--microbatch-size", str(mb)]
        if timing != "default":
            at += ["--timing", timing]
            tag += f"-{timing}"
        if accum:
            tag += f"-accum{accum}"
        if busy:  # timed beside a companion on every other GPU
            at += ["--ranks-per-host", str(self.n)]
            tag += "-busy"
        # the model's config in the name: a --work folder shared between calls must not serve another model
        digest = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:8]
        name = f"{tag}-{sizes.replace(',', '_') if sizes else mb}-{digest}"
        path = self.work / f"profile-{name}.json"
        if not path.exists():
            rc, out = self.sh([sys.executable, "-m", "partitioner.profiler", "--model", "gpt", "--model-args",
                               json.dumps(cfg), *at, "--device", self.device, "--dtype", self.dtype,
                               "-o", str(path)], self.work / f"profile-{name}.log",
                              {"PIPEFLOW_GRAD_ACCUM": accum} if accum else None)
            if rc != 0:
                print(f"  pipeflow-profile failed (rc {rc}): {out.strip().splitlines()[-1:]}", flush=True)
                return None
        return path

    def plan(self, prof: Path, schedule: str, m: int, split: str, tag: str, mem_gib: float | None = None,
             global_batch: bool = False, warmup: str | None = None, straight: bool = False,
             shard: bool = False) -> tuple[Path | None, str]:
        """plan.json: pipeflow-plan's (split "plan": under `mem_gib` GiB per worker if given, else the card's
        memory; with `global_batch`, b and m chosen for the sequences), or a given split priced by --evaluate."""
        topo = self.a.topology or f"{self.n}x300GB/s"
        out_path = self.work / f"plan-{tag}.json"
        common = ["--topology", topo, "--optimizer", "adam", "-o", str(out_path), str(prof)]
        if split == "plan" and mem_gib is not None:
            common[:0] = ["--memory-per-worker", str(int(mem_gib * 2**30))]
        elif not self.a.cpu and split == "plan":  # 90% of the card's memory (as on the spot): a plan must not
            # replicate what cannot fit
            # (planning only: --evaluate prices a given split as written and refuses search flags)
            import torch

            common[:0] = ["--memory-per-worker",
                          str(int(GPU_SHARE * torch.cuda.get_device_properties(0).total_memory))]
        if split == "plan":
            shape = ["--global-batch", str(self.a.sequences)] if global_batch else ["--microbatches", str(m)]
            cmd = [sys.executable, "-m", "partitioner.cli", "--workers", str(self.n), "--schedule", schedule,
                   *shape, *(["--straight"] if straight else []), *(["--shard-optimizer"] if shard else []), *common]
        else:
            counts = [int(c) for c in split.split(",")]
            bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
            given = {"format": "pipeflow.plan/1", "schedule": schedule, "microbatches": m, "workers": len(counts),
                     "stages": [{"layers": [a, b], "replicas": 1, "ranks": [i]}
                                for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]}
            if warmup and warmup[0].isdigit():  # priced with the warm-up the row runs
                given["warmup"] = [int(x) for x in warmup.split(",")]
            src = self.work / f"given-{tag}.json"
            src.write_text(json.dumps(given))
            cmd = [sys.executable, "-m", "partitioner.cli", "--evaluate", str(src), *common]
        rc, out = self.sh(cmd, self.work / f"plan-{tag}.log")
        if rc != 0:
            return None, out.strip().splitlines()[-1] if out.strip() else f"rc {rc}"
        plan = json.loads(out_path.read_text())
        return out_path, ",".join(f"{st['layers'][1] - st['layers'][0]}" + (f"(x{st['replicas']})" if
                                  st["replicas"] > 1 else "") for st in plan["stages"]) + (
            ", gemm accumulation (the plan's)" if plan.get("accumulation") == "gemm" else "")

    def pf(self, schedule: str, mb: int, m: int, split: str, big: bool = False, grain: str | None = None,
           mem_gib: float | None = None, sizes: str | None = None, trace: bool = False, cal: bool = False,
           timing: str = "default", warmup: str | None = None, straight: bool = False,
           p2p: str | None = None, accum: str | None = None, busy: bool = False, shard: bool = False,
           flat: bool = False, env: dict[str, str] | None = None, clip: str | None = None,
           card: float | None = None) -> None:
        """A pipeflow-train row. With `sizes` (a gb row) the profile holds those microbatch sizes and
        pipeflow-plan --global-batch picks b, m and the split; mb and m are then what it picked."""
        cfg = self.big if big else self.gpt
        trace = trace or cal
        if timing == "graphs":  # profiled as a graph replays the chain, and trained so
            env = {**(env or {}), "PIPEFLOW_CUDA_GRAPHS": "1"}
        if grain:
            cfg = {**cfg, "granularity": GRAINS[grain]}
        shape = f"gb{sizes.replace(',', '_')}" if sizes else f"{mb}x{m}"
        tag = (f"{'big-' if big else ''}{grain + '-' if grain else ''}{schedule}-{shape}-{split.replace(',', '_')}"
               + (f"-mem{mem_gib:g}" if mem_gib is not None else "") + (f"-{timing}" if timing != "default" else "")
               + (f"-warmup{warmup.replace(',', '_')}" if warmup else "") + ("-straight" if straight else "")
               + (f"-{p2p}" if p2p else "") + (f"-accum{accum}" if accum else "") + ("-busy" if busy else "")
               + ("-shard" if shard else "") + ("-flat" if flat else "") + ("-trace" if trace else "")
               + "".join(f"-{k}{v}" for k, v in (env or {}).items()) + (f"-clip{clip}" if clip else "")
               + (f"-card{card:g}" if card else ""))
        name = (f"pipeflow {schedule}" + (" (large model)" if big else "")
                + (f", {GRAINS[grain]} layers" if grain else "") + (f", clipped at {clip}" if clip else ""))
        flags = (["--schedule", schedule] + (["--warmup", warmup] if warmup else [])
                 + (["--clip-grad-norm", clip] if clip else []))
        predicted, calibrated, shown, path, prof = None, None, split, None, None
        if split != "spot":
            kind = ("big" if big else "gpt") + (f"-{grain}" if grain else "")
            prof = self.profile(cfg, mb, kind, sizes=sizes, timing=timing, accum=accum, busy=busy)
            path, shown = (self.plan(prof, schedule, m, split, tag, mem_gib=mem_gib, global_batch=sizes is not None,
                                     warmup=warmup, straight=straight, shard=shard)
                           if prof else (None, "no profile"))
            if path is None:
                if split == "plan":
                    self.add(name, f"{shape}, plan: {shown}", self.n, 1, shown, cfg)
                    return
                flags += ["--layers-per-stage", split]
                shown = split
            else:
                flags += ["--plan", str(path)]
                plan = json.loads(path.read_text())
                predicted = plan.get("predicted", {}).get("step_ms")
                if sizes:  # the planner's pick
                    mb, m = int(plan["planner"]["microbatch_size"]), int(plan["microbatches"])
                if prof is not None and not cal:
                    calibrated = self.calibrated_ms(prof, path, tag, timing)
        held = ([str(ROOT / "benchmarks/gpu/card.py"), f"{card:g}", "pipeflow.train"] if card
                else ["-m", "pipeflow.train"])
        cmd = ["mpirun", "-np", str(self.n), sys.executable, *held, "--model", "gpt", "--model-args",
               json.dumps(cfg), "--device", self.device, "--dtype", self.dtype, "--optimizer", "adam", "--lr", "1e-4",
               "--steps", str(self.a.steps), "--log-every", str(max(1, self.a.steps // 3)),
               "--microbatch-size", str(mb), "--microbatches", str(m), *flags]
        if self.peak:
            cmd += ["--peak-tflops", str(self.peak)]
        trace_path = self.work / f"trace-{tag}.json"
        if trace:
            trace_path.unlink(missing_ok=True)  # never an earlier call's (--work shared)
            cmd += ["--trace", str(trace_path)]
        given = dict(env or {})
        env = {**({"PIPEFLOW_P2P": p2p} if p2p else {}), **({"PIPEFLOW_GRAD_ACCUM": accum} if accum else {}),
               **({"PIPEFLOW_REDUCE_INPLACE": FLAT} if flat else {}), **given}
        rc, out = self.sh(cmd, self.work / f"pf-{tag}.log", env)
        if trace and rc == 0 and trace_path.exists():
            for line in breakdown(json.loads(trace_path.read_text()), skip=max(1, self.a.steps // 3)):
                print(f"BREAKDOWN {tag} {line}", flush=True)
            if cal and prof is not None and path is not None:
                self.calibrate(prof, path, trace_path, tag, timing)
        if split == "spot":
            got = re.search(r"'step_ms': ([0-9.e+-]+)", out)
            predicted = float(got.group(1)) if got else None
        peaks = re.search(r"peak GPU memory per rank \(GiB\): \[([^\]]*)\]", out)
        peak = "/".join(x.strip() for x in peaks.group(1).split(",")) if peaks else "-"
        note = "" if mb * m == self.a.sequences else f" ({mb * m} sequences per step)"
        how = (f"{mb} x {m} (planner's pick of {sizes})" if sizes else f"{mb} x {m}") + f", {split}"
        if mem_gib is not None:
            how += f" under {mem_gib:g} GiB"
        if timing != "default":
            how += f", profiled --timing {timing}"
        if warmup:
            how += f", --warmup {warmup}"
        if straight:
            how += ", --straight"
        if shard:
            how += ", --shard-optimizer"
        if flat:
            how += f", PIPEFLOW_REDUCE_INPLACE={FLAT}"
        for k, v in given.items():
            how += f", {k}={v}"
        if p2p:
            how += f", PIPEFLOW_P2P={p2p}"
        if accum:
            how += f", PIPEFLOW_GRAD_ACCUM={accum}"
        if busy:
            how += ", profiled beside busy GPUs"
        if card:
            used = sorted(re.findall(r"CARD rank (\d+) .*peak in use ([0-9.]+) GiB(.*)", out))
            how += (f", held to {card:g} GiB per GPU: peak in use " + "/".join(u for _, u, _ in used)
                    + (" (OVER)" if any("over" in x for _, _, x in used) else ""))
        if trace:
            how += ", --trace" + (" (calibrates the later rows)" if cal else "")
        self.add(name, how + (f" {shown}" if shown != split else "") + note, self.n, rc, out, cfg,
                 predicted=predicted, peak=peak, sequences=mb * m, calibrated=calibrated)

    def calibrate(self, prof: Path, plan: Path, trace: Path, tag: str, timing: str) -> None:
        """The runtime's costs from a traced row (partitioner.calibrate), kept for the rows after it whose profile
        was timed the same way."""
        out = self.work / f"cal-{tag}.json"
        # every earlier 'cal' row of this timing too: two microbatch sizes tell a compute factor from a cost
        # per action (partitioner.calibrate --also)
        also = [x for run in self.cal_runs.get(timing, []) for x in ("--also", *map(str, run))]
        rc, text = self.sh([sys.executable, "-m", "partitioner.calibrate", str(prof), str(plan), str(trace), *also,
                            "--skip", str(max(1, self.a.steps // 3)), "-o", str(out)], self.work / f"cal-{tag}.log")
        if rc != 0:
            print(f"  calibrate failed (rc {rc}): {text.strip().splitlines()[-1:]}", flush=True)
            return
        found, before = json.loads(out.read_text()), json.loads(prof.read_text())
        # what calibrate read from the trace: the output keeps the profile's own fields (a measured GPU-to-GPU
        # copy bandwidth is not an all-reduce's), so only what it added or changed
        cal = {k: found[k] for k in CALIBRATED if k in found and found[k] != before.get(k)}
        self.cal[timing] = cal
        self.cal_runs.setdefault(timing, []).append((prof, plan, trace))
        print(f"CALIBRATED {tag} {json.dumps(cal)}", flush=True)

    def calibrated_ms(self, prof: Path, plan: Path, tag: str, timing: str) -> float | None:
        """`plan` priced on `prof` with the calibrated costs (at every microbatch size of the file; the plan's
        microbatch size at the top, where --evaluate reads), None before any 'cal' row profiled the same way.
        An all-reduce bandwidth calibrated from a traced plan with replicas replaces --topology's."""
        cal = self.cal.get(timing)
        if not cal:
            return None
        d = json.loads(prof.read_text())
        for at in [d, *d.get("other_microbatch_sizes", [])]:
            at.update(cal)
        b = json.loads(plan.read_text()).get("planner", {}).get("microbatch_size", d["microbatch_size"])
        if b != d["microbatch_size"]:  # --evaluate prices at the top level: the plan's own size goes there
            sizes = [d, *d.pop("other_microbatch_sizes", [])]
            top = next(x for x in sizes if x["microbatch_size"] == b)
            d = {**top, "other_microbatch_sizes": [x for x in sizes if x is not top]}
        cal_prof, out = self.work / f"profile-{tag}-cal.json", self.work / f"plan-{tag}-cal.json"
        cal_prof.write_text(json.dumps(d))
        topo = [] if "link_bandwidth" in cal else ["--topology", self.a.topology or f"{self.n}x300GB/s"]
        rc, text = self.sh([sys.executable, "-m", "partitioner.cli", "--evaluate", str(plan), *topo, "--optimizer",
                            "adam", "-o", str(out), str(cal_prof)], self.work / f"plan-{tag}-cal.log")
        if rc != 0:
            print(f"  calibrated pricing failed (rc {rc}): {text.strip().splitlines()[-1:]}", flush=True)
            return None
        return json.loads(out.read_text()).get("predicted", {}).get("step_ms")

    def run(self, rows: str) -> None:
        for text in [r.strip() for r in rows.split(";") if r.strip()]:
            w = text.split()
            print(f"=== {text} ({time.strftime('%H:%M:%S')})", flush=True)
            try:
                if w[0] == "single":
                    self.single(int(w[1]))
                elif w[0] == "singles":
                    self.singles(int(w[1]))
                elif w[0] == "ddp":
                    self.ddp(int(w[1]))
                elif w[0] == "torch":
                    self.torch(w[1], int(w[2]), w[3] if len(w) > 3 else None)
                elif w[0] in ("pf", "big"):
                    extra = w[5:]
                    mem = [float(x[4:]) for x in extra if x.startswith("mem=")]
                    warm = [x[7:] for x in extra if x.startswith("warmup=")]
                    p2p = [x[4:] for x in extra if x.startswith("p2p=")]
                    accum = [x[6:] for x in extra if x.startswith("accum=")]
                    clip = [x[5:] for x in extra if x.startswith("clip=")]
                    card = [float(x[5:]) for x in extra if x.startswith("card=")]
                    words = (*GRAINS, "trace", "cal", "straight", "shard", "busy", "flat", *TIMED,
                             *P2P_WORDS, *ACCUM_WORDS)
                    envs = dict(x[4:].split("=", 1) for x in extra if x.startswith("env:") and "=" in x[5:])
                    bad = [x for x in extra if x not in words
                           and not x.startswith(("mem=", "warmup=", "clip=", "card="))
                           and not (x.startswith("env:") and "=" in x[5:])]
                    if (bad or ((mem or {"straight", "shard"} & set(extra)) and w[4] != "plan")
                            or (w[4] == "spot" and {"cal", "busy", *TIMED} & set(extra))
                            or len(set(TIMED) & set(extra)) > 1 or len(set(GRAINS) & set(extra)) > 1
                            or len(warm) > 1 or len(p2p) > 1 or len(accum) > 1 or len(clip) > 1 or len(card) > 1):
                        raise ValueError(f"after the split a {w[0]} row takes 'sub' or 'fine', 'trace', 'cal', "
                                         f"'busy', 'flat', 'env:NAME=VALUE', 'clip=MAX', 'card=GIB', one of "
                                         f"{', '.join(TIMED)} (not with 'spot'), 'warmup=W', one of "
                                         f"{', '.join(P2P_WORDS)}, one of {', '.join(ACCUM_WORDS)} and, with "
                                         f"'plan', 'mem=GIB', 'straight' and 'shard'; found {' '.join(extra)!r}")
                    self.pf(w[1], int(w[2]), int(w[3]), w[4], big=w[0] == "big", grain=_grain(extra),
                            mem_gib=mem[0] if mem else None, trace="trace" in extra, cal="cal" in extra,
                            timing=_timing(extra), warmup=warm[0] if warm else None, straight="straight" in extra,
                            shard="shard" in extra, flat="flat" in extra, env=envs,
                            p2p=p2p[0] if p2p else None, accum=accum[0] if accum else None, busy="busy" in extra,
                            clip=clip[0] if clip else None, card=card[0] if card else None)
                elif w[0] == "gb":
                    extra = w[3:]
                    mem = [float(x[4:]) for x in extra if x.startswith("mem=")]
                    if (len(w) < 3 or [x for x in extra if x not in (*GRAINS, *TIMED) and not x.startswith("mem=")]
                            or len(set(TIMED) & set(extra)) > 1 or len(set(GRAINS) & set(extra)) > 1):
                        raise ValueError("a gb row is 'gb SCHEDULE SIZES [sub|fine] [idle|kernels|stage|graphs] "
                                         "[mem=GIB]', "
                                         "e.g. "
                                         "'gb 1f1b 2,4,8'")
                    self.pf(w[1], 0, 0, "plan", grain=_grain(extra), sizes=w[2], mem_gib=mem[0] if mem else None,
                            timing=_timing(extra))
                else:
                    raise ValueError(f"unknown row kind {w[0]!r}")
            except (IndexError, ValueError) as e:
                print(f"RESULT row {text!r} not understood: {e}", flush=True)

    def table(self) -> str:
        cols = ["run", "config", "tokens/s", "peak GiB/rank", "MFU/GPU", "step ms", "predicted ms", "calibrated ms"]
        lines = [f"{self.n if not self.a.cpu else 2} x {self.card}, {time.strftime('%Y-%m-%d')}, "
                 f"{self.a.sequences} sequences per step, GPT {json.dumps(self.gpt)}, peak "
                 f"{self.peak if self.peak else '?'} TFLOP/s per device", "",
                 "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in self.rows]
        return "\n".join(lines) + "\n"


def breakdown(trace: dict[str, object], skip: int) -> list[str]:
    """Per rank, ms per step (steps from `skip` on, the last left out: its end is not seen) in each kind of span
    and idle: the step's period (its first span's start to the next step's) less every span in it."""
    from partitioner.calibrate import _spans

    lines = []
    for rank, steps in sorted(_spans(trace).items()):
        starts = {step: spans[0][1] for step, spans in steps.items() if spans}
        kept = [st for st in sorted(steps) if st >= skip and st + 1 in starts]
        if not kept:
            continue
        totals: dict[str, float] = {}
        for st in kept:
            for kind, a, b in steps[st]:
                key = kind if kind in ("F", "B", "W", "STEP") else kind.split("_")[0]
                totals[key] = totals.get(key, 0.0) + (b - a)
        period = sum(starts[st + 1] - starts[st] for st in kept) / len(kept)
        per = {k: v / len(kept) for k, v in totals.items()}
        idle = period - sum(per.values())
        lines.append(f"rank {rank}: period {period:.1f} ms = " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(
            per.items())) + f", idle {idle:.1f} (steps {kept[0]}-{kept[-1]})")
    return lines


def even_split(blocks: int, stages: int) -> list[int]:
    """Layer counts: the blocks as even as possible (the earlier stages take the remainder), the embedding on the
    first stage and the head on the last."""
    counts = [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]
    counts[0] += 1
    counts[-1] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    bench.run(args.rows or (CPU_ROWS if args.cpu else DEFAULT_ROWS))
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or ".") / "results.md"
    out.write_text(bench.table())
    print(bench.table())
    return 0 if all(not r["tokens/s"].startswith("FAILED") for r in bench.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
