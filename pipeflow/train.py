"""`pipeflow-train`: pipeline-parallel training under MPI.

    mpirun -np 4 pipeflow-train --model gpt --schedule 1f1b --steps 50
    mpirun -np 4 pipeflow-train --model gpt --plan plan.json --steps 50 --tensorboard runs/gpt
    mpirun -np 2 pipeflow-train --model mlp --schedule gpipe --steps 3 --dtype float64 --save mlp.pt
    pipeflow-train --model gpt --steps 20        # one process: a single stage

With no --plan the layers are profiled and planned on the spot for the -np given.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from partitioner.plan import PlanError
from pipeflow import config, evalflags
from pipeflow.failure import UsageError
from pipeflow.outputs import release_checkpoint_lock
from pipeflow.preflight import set_up
from pipeflow.runner import DTYPES, run
from pipeflow.schedule import SCHEDULES, ScheduleError

if TYPE_CHECKING:
    from pipeflow.control import Control

log = logging.getLogger("pipeflow")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, written once: every rank parses the same argv before MPI starts, so only the process
        that the launcher calls rank 0 (or one not started by a launcher) says it."""
        rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMIX_RANK")
        if rank in (None, "0"):
            os.write(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n".encode())
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pipeflow-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt",
                   help="gpt, mlp or package.module:function (default gpt). The module is imported and the "
                        "function called with --model-args on every rank: like torch.load without weights_only, "
                        "this runs that code, so name only modules you trust")
    p.add_argument("--model-args", default=None, help="JSON object of builder keyword arguments")
    p.add_argument("--plan", default=None, help="plan.json from pipeflow-plan; default: plan on the spot")
    p.add_argument("--schedule", default=None,
                   help=f"one of {', '.join(SCHEDULES)} (default: the plan's; planning on the spot, the flush "
                        "schedule of highest predicted throughput, as pipeflow-plan --schedule auto; with "
                        "--layers-per-stage, 1f1b)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (minibatches) to train")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per minibatch (default: plan's or 8)")
    p.add_argument("--microbatch-size", type=int, default=None,
                   help=f"samples per microbatch (default {config.MICROBATCH_SIZE}; with --global-batch G, the "
                        "planner's choice, or this size, which G must be a multiple of)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-shuffle", action="store_true", help="samples in order instead of a seeded permutation")
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="adam")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (the peak, with --lr-warmup/--lr-decay)")
    p.add_argument("--lr-warmup", type=int, default=0, metavar="N",
                   help="linear warm-up: update u < N at --lr * (u + 1) / (N + 1) (default 0: none)")
    p.add_argument("--lr-decay", choices=("none", "cosine", "linear"), default="none",
                   help="after the warm-up, decay the lr from --lr to --min-lr at update --lr-decay-steps (nanoGPT's "
                        "get_lr, Megatron's --lr-decay-style; update u is minibatch u's, docs/schedules.md)")
    p.add_argument("--min-lr", type=float, default=0.0, help="the lr the decay reaches and then keeps (default 0)")
    p.add_argument("--lr-decay-steps", type=int, default=None, metavar="K",
                   help="the update at which the decay reaches --min-lr (default --steps; give a run and its --resume "
                        "the same K where their --steps differ, so that both follow one curve)")
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="cast the model to this dtype (default: keep the dtype its builder gave it)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for a peer before failing")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write checkpoints to DIR/step-NNNNNN/ (a file per stage, then a COMPLETE marker)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="steps between checkpoints (default 0: at the end, and when stopped by SIGTERM/SIGINT); "
                        "async/2bw drain their pipeline at each checkpoint (segments of K minibatches)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue from PATH (a step-NNNNNN directory or a checkpoint directory) or, without "
                        "PATH, from the newest complete checkpoint in --checkpoint-dir (none yet: from step 0)")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip steps whose loss or gradients are NaN/inf instead of stopping")
    p.add_argument("--max-skips", type=int, default=10, metavar="N",
                   help="with --skip-nonfinite: stop (exit 4) after N consecutive skipped steps (default 10; "
                        "0: never)")
    p.add_argument("--save", default=None, help="write the trained model's state_dict here (rank 0)")
    p.add_argument("--log-every", type=int, default=0, help="steps between loss reports (default 0: steps/10)")
    p.add_argument("--eval-every", type=int, default=0, metavar="K", help=evalflags.EVERY_HELP)
    p.add_argument("--eval-batches", type=int, default=1, metavar="N", help="minibatches per evaluation (default 1)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard scalars here (throughput, loss, per-stage times, bubble, memory)")
    p.add_argument("--trace", default=None, metavar="FILE.json",
                   help="write every rank's measured timeline as a Chrome trace (open in ui.perfetto.dev)")
    p.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                   help="peak TFLOP/s of one device, for model FLOPs utilisation (MFU) in the steady-state line and "
                        "TensorBoard's throughput/mfu (default: known GPUs' dense bf16/fp32 peak; none on CPUs)")
    p.add_argument("--vertical-sync", action="store_true",
                   help="async: every stage uses the weight version stage 0 used (PipeDream §3.3)")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="replicated stages: each replica keeps the optimizer state of, and updates, its share of the "
                        "stage's parameters, then sends them to the others (ZeRO stage 1); the same weights, 1/r of "
                        "the optimizer state per replica")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="before each optimizer step, scale the gradients so that their global L2 norm (over every "
                        "stage, after the replicas' sum) is at most MAX, as torch.nn.utils.clip_grad_norm_ in one "
                        "process: DeepSpeed's gradient_clipping; one small all-gather per step; not with --schedule "
                        "async (its stages update at different times)")
    p.add_argument("--layers-per-stage", default=None,
                   help="with no --plan: 'even', or comma-separated layer counts per stage (e.g. 8,6,6,6), instead "
                        "of profiling and planning on the spot")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="--schedule interleaved: V model chunks per rank, placed round-robin (Megatron's interleaved "
                        "1F1B; default: the plan's, or 2); --microbatches must be a multiple of the ranks per "
                        "pipeline")
    p.add_argument("--straight", action="store_true", help="planning on the spot: no replicated stages")
    p.add_argument("--topology", default=None, help="planning on the spot: e.g. 8x300GB/s,4x25GB/s")
    p.add_argument("--global-batch", type=int, default=None, metavar="G",
                   help="planning on the spot: samples per step; the planner picks the microbatch size b among "
                        "the powers of two dividing G (the 4 largest, up to 64) and m = G / b")
    p.add_argument("--memory-per-worker", default=None,
                   help="planning on the spot: e.g. 16GB (default: 90%% of the GPU's memory; on CPU the host's RAM "
                        "shared by its ranks)")
    p.add_argument("--warmup", default="plan",
                   help="1f1b and 2bw forwards before the first backward, per stage: plan (default: the plan's, which "
                        "pipeflow-plan deepens for 1f1b where its simulation gains; else min), min (DAPPLE, "
                        "S-1-s), fill (keep early stages busy until their first gradient returns; more activation "
                        "memory), or N,N,...")
    return p


def check_args(args: argparse.Namespace) -> config.TrainConfig:
    """The parsed flags as the validated TrainConfig the runtime reads (config.py); ValueError in one line."""
    return config.TrainConfig.from_flags(vars(args), os.environ)


def setup_logging(rank: int, size: int) -> None:
    """A handler once per process (basicConfig does nothing the second time); the level from
    $PIPEFLOW_LOG at every call, so that each run of main() in one process gets its own."""
    prefix = f"[rank {rank}] " if size > 1 else ""
    try:
        level = config.log_level(os.environ.get("PIPEFLOW_LOG"))
    except config.ConfigError:
        level = logging.INFO  # reported by check_args, once, with the other set-up errors
    logging.basicConfig(level=level, stream=sys.stderr, format=f"{prefix}%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)


class ProcessState:
    """Process-wide state a run changes, saved before and restored after it, so that main() can run
    many times in one process (tests/mpi_batch.py runs a test suite's cases in one MPI job) with no
    run seeing another's: the global RNGs (build_model seeds them), the default dtype, the SIGTERM /
    SIGINT handlers (an agreed stop returns before Supervisor.close restores them), the log level."""

    def __init__(self) -> None:
        import signal

        from pipeflow.signals import SignalStop

        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.dtype = torch.get_default_dtype()
        self.signals = {s: signal.getsignal(s) for s in SignalStop.SIGNALS}
        self.log_level = logging.getLogger().level

    def restore(self) -> None:
        import signal
        import threading

        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        torch.set_default_dtype(self.dtype)
        logging.getLogger().setLevel(self.log_level)
        if threading.current_thread() is threading.main_thread():
            for s, handler in self.signals.items():
                if handler is not None:
                    signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dump = config.stack_dump_seconds(os.environ)  # a bad value is reported with the other set-up errors
    if dump:  # debugging a hang: every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(dump, exit=True)
    from pipeflow.comm import shutdown
    from pipeflow.control import Control
    from pipeflow.cudaenv import eager_cuda_modules
    from pipeflow.watchdog import Watchdog, write_pid_file

    eager_cuda_modules()  # before any CUDA call, planning on the spot's profiling included (cudaenv.py says why)

    comm = Control.world()  # MPI is initialised once per process, by the import
    state = ProcessState()
    setup_logging(comm.rank, comm.size)
    write_pid_file()
    # Peer heartbeats: a rank that dies or stops ends the job within --timeout, even where MPI would wait.
    watchdog = Watchdog(comm, args.timeout if args.timeout > 0 else 300.0).start()
    atexit.register(watchdog.stop)
    try:
        code = _main(args, comm, watchdog)
        watchdog.stop(sync=True)  # _main returns on all ranks together: none beats at a finalised peer
    except KeyboardInterrupt:  # SIGINT outside the training steps (which stop at a boundary): set-up, save
        if comm.rank == 0:
            from pipeflow.failure import say

            say("pipeflow-train: stopped by SIGINT outside the training steps; nothing saved")
        sys.stderr.flush()
        os._exit(130)  # 128 + SIGINT; threads may be inside gloo: leave without unwinding them
    finally:
        watchdog.stop()
        atexit.unregister(watchdog.stop)
        shutdown()  # an agreed stop or error returns with the group still up
        state.restore()
        release_checkpoint_lock()
    return code


def _main(args: argparse.Namespace, comm: Control, watchdog: Any) -> int:
    from pipeflow.failure import EXIT_FAILED, EXIT_NONFINITE, AgreedError, NonFiniteError, StopTraining, say

    rank = comm.rank
    ready = set_up(vars(args), comm)  # every check, agreed between the ranks (preflight.py); None: the line is written
    if ready is None:
        return 2
    cfg, spec, plan, list_size = ready.cfg, ready.spec, ready.plan, ready.list_size
    if rank == 0 and list_size > config.SLOW_SCHEDULE_MICROBATCHES:
        log.info("building the %s action lists of %d microbatches on every rank (up to minutes for 10^6)",
                 plan.schedule, list_size)
    try:
        return run(cfg, spec, plan, comm, watchdog)
    except StopTraining as e:  # every rank stopped at the same step boundary
        if rank == 0:
            say(f"pipeflow-train: {e}")
        return e.code
    except AgreedError as e:
        if rank == 0:
            say(f"pipeflow-train: error: {e}")
        return 2
    except NonFiniteError as e:  # asynchronous schedules: no common boundary to stop at together
        say(f"pipeflow-train: error: [rank {rank}] {e}")
        comm.abort(EXIT_NONFINITE)
        return EXIT_NONFINITE
    except (UsageError, PlanError, ScheduleError) as e:
        say(f"pipeflow-train: error: [rank {rank}] {e}")
        comm.abort(2)
        return 2
    except Exception as e:
        silent = watchdog.suspects()  # a transfer failed: was it a dead or stopped peer?
        if silent:  # the peer's failure is the news; this rank's traceback would only bury it
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            say(f"pipeflow-train: error: [rank {rank}] rank {', '.join(map(str, silent))} stopped responding "
                f"(no heartbeat; here: {first}). Stopping all ranks.")
            comm.abort(EXIT_FAILED)
            return EXIT_FAILED
        traceback.print_exc()
        say(f"pipeflow-train: rank {rank} failed (traceback above); stopping all ranks")
        comm.abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
