"""Checkpoints stored per layer (model-wide keys): atomic per-stage files, a COMPLETE marker, resume.

    D/step-000005/stage-000.pt   weights, optimizer state, RNG of (model) stage 0
    D/step-000005/stage-001.pt
    D/step-000005/COMPLETE       JSON written by rank 0 once every stage confirmed its file, with each
                                 file's size and sha256, so that a resume can verify them exactly, and the
                                 steps skipped so far (--skip-nonfinite), so that --max-skips holds across it

Weights use the keys of nn.Sequential(*spec.layers) ("3.fc.weight") and optimizer state is keyed by
the same parameter names, so a checkpoint resumes under any plan or number of workers. A rank holding
several chunks (--schedule interleaved: model stage k on rank group k mod S) writes one file per chunk, so
the files are one per model stage, whatever the plan, and the format is the same. The data
position is the step: the sample order is a pure function of the seed and the step (data/loader.py).

This module is the format and the writing side; restore.py finds, verifies and loads checkpoints.
"""
from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from partitioner.jsonfile import atomic_write, write_json
from pipeflow.control import OPTIMIZER_STATE_TAG

if TYPE_CHECKING:
    from pipeflow.config import TrainConfig

log = logging.getLogger(__name__)

CKPT_FORMAT = "pipeflow.checkpoint/1"
MARKER = "COMPLETE"
_STEP_RE = re.compile(r"^step-(\d+)$")
# Run settings that must match on resume, or the data position would mean other samples.
MUST_MATCH = ("seed", "shuffle", "samples_per_step")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, truncated, foreign or does not fit this run."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def stage_file(d: Path, stage: int) -> Path:
    return d / f"stage-{stage:03d}.pt"


# ---------------------------------------------------------------------------------------- writing


def chunks(engine: Any) -> dict[int, Any]:
    """Model stage -> Stage of the chunks this rank holds (engine.stages: several under interleaving). An
    engine-like object with only `.stage` and its stage index `.s` holds one chunk."""
    stages = getattr(engine, "stages", None)
    return dict(stages) if stages else {engine.s: engine.stage}


def chunk_layers(chunk: Any) -> tuple[int, int]:
    """The model-wide layers [start, end) of a chunk."""
    return chunk.start, chunk.start + len(chunk.module)


def _param_names(engine: Any) -> dict[int, list[str]]:
    """id(parameter) -> its model-wide names ("3.fc.weight"), over every chunk of this rank: several for a
    Parameter that layers share (tied weights), whose optimizer state is then written under each, as its
    weight is."""
    out: dict[int, list[str]] = {}
    for chunk in chunks(engine).values():
        for k, p in chunk.module.named_parameters(remove_duplicate=False):
            idx, _, rest = k.partition(".")
            out.setdefault(id(p), []).append(f"{int(idx) + chunk.start}.{rest}")
    return out


def _layer(key: str) -> int:
    head = key.partition(".")[0]
    return int(head) if head.isdigit() else -1


def optimizer_state(engine: Any, layers: tuple[int, int] | None = None) -> dict[str, Any]:
    """torch's optimizer state_dict with parameter indices replaced by model-wide parameter names; with
    `layers` [a, b), only the names of those layers (one chunk's share of the rank's single optimizer)."""
    opt = engine.optimizer
    names = _param_names(engine)
    if layers is not None:
        names = {i: [n for n in ns if layers[0] <= _layer(n) < layers[1]] for i, ns in names.items()}
    order = [names.get(id(p), []) for g in opt.param_groups for p in g["params"]]  # none: a placeholder (update.py)
    sd = opt.state_dict()
    state = {name: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in sd["state"].items() for name in order[i]}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [order[i][0] for i in g["params"]
                                                                           if order[i]]}
              for g in sd["param_groups"]]
    return {"class": type(opt).__name__, "state": state, "groups": groups}


def sharded_states(engine: Any, comm: Any) -> dict[int, dict[str, Any]] | None:
    """Collective over a sharded stage's replicas (--shard-optimizer, pipeflow/shard.py): each holds the optimizer
    state of its share of the parameters, so replica 0, which writes the stage's files, receives the others'
    (MPI, in replica order) and returns each chunk's whole state, in the optimizer's order without sharding;
    None on the other replicas and without sharding."""
    shard = getattr(engine, "shard", None)
    if shard is None:
        return None
    mine = {k: optimizer_state(engine, chunk_layers(c)) for k, c in chunks(engine).items()}
    if engine.r != 0:
        comm.send(mine, dest=shard.ranks[0], tag=OPTIMIZER_STATE_TAG)
        return None
    order = {n: i for i, ns in enumerate(_param_names(engine)[id(p)] for p in engine.parameters()) for n in ns}
    for q in range(1, shard.replicas):
        for k, other in comm.recv(source=shard.ranks[q], tag=OPTIMIZER_STATE_TAG).items():
            mine[k]["state"].update(other["state"])
            for g, h in zip(mine[k]["groups"], other["groups"]):
                g["params"] = sorted(g["params"] + h["params"], key=order.__getitem__)
    for opt in mine.values():
        opt["state"] = dict(sorted(opt["state"].items(), key=lambda kv: order[kv[0]]))
    return mine


def stage_payload(engine: Any, step: int, run_info: dict[str, Any], k: int | None = None,
                  optimizer: dict[str, Any] | None = None) -> dict[str, Any]:
    """The file of model stage `k` (default: the rank's first chunk): its weights and optimizer state (`optimizer`:
    as sharded_states gathered it), and the rank's RNG state (the same in every file of the rank)."""
    k = engine.s if k is None else k
    shard = getattr(engine, "shard", None)
    if shard is not None:  # the weights of a sharded update in place (shard.py: they land under the next forward)
        shard.finish()
    chunk = chunks(engine)[k]
    a, b = chunk_layers(chunk)
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if engine.world.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(engine.world.device)
    return {"format": CKPT_FORMAT, "step": step, "stage": k, "layers": [a, b],
            "weights": {name: v.clone() for name, v in chunk.model_state_dict().items()},
            "optimizer": optimizer if optimizer is not None else optimizer_state(engine, (a, b)), "rng": rng,
            "extra": None, "run": run_info}  # "extra": kept in the format, unused


class _HashingSink:
    """The file object torch.save writes to: hashes the bytes on the way, and keeps the OSError of a failed
    write, which torch's zip writer turns into a RuntimeError without the errno ("unexpected pos")."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, b: bytes) -> int:
        try:
            n = self.f.write(b)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(b)
        self.size += len(b)
        return n

    def flush(self) -> None:
        self.f.flush()


def write_torch(path: Path, obj: Any, *, sweep: bool = False) -> tuple[int, str]:
    """torch.save `obj` to `path` atomically (`sweep`: first removing the temporary files of `path` that killed
    writers left, jsonfile.remove_leftovers); returns (bytes, sha256 hex). A failed write raises its OSError
    (ENOSPC names itself), not torch's errno-less RuntimeError."""
    digest: list[tuple[int, str]] = []

    def write(f: IO[bytes]) -> None:
        sink = _HashingSink(f)
        try:
            torch.save(obj, sink)  # type: ignore[arg-type]  # a file-like object with write()
        except RuntimeError:
            if sink.error is not None:
                raise sink.error from None
            raise
        digest.append((sink.size, sink.sha.hexdigest()))

    atomic_write(path, write, sweep=sweep)
    return digest[0]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def reason(e: BaseException) -> str:
    """An exception as the end of one line: an OSError's strerror (\"No space left on device\")."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def save(engine: Any, root: str | Path, step: int, comm: Any, run_info: dict[str, Any], *,
         skipped: tuple[int, int] = (0, 0)) -> Path:
    """Collective: replica 0 of every rank group writes the file of each stage it holds (one per chunk under
    interleaving), removing first what a writer killed before it left of that file (its temporary files: a step
    written again after a kill -9); rank 0 writes COMPLETE, with every file's size and sha256 and its writer's
    `skipped` (steps skipped in a row and in all, guard.StepGuard), once all confirmed. A failure on any rank raises
    CheckpointError on every rank ("checkpoint of step 5 to D/step-000005 failed: ...: No space left on device"),
    the step left without its marker."""
    d = step_dir(root, step)
    error: str | None = None
    if comm.Get_rank() == 0:
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / MARKER).unlink(missing_ok=True)  # rewriting a step: incomplete until every file is new
        except OSError as e:
            error = f"cannot create the directory: {e.strerror}"
    comm.Barrier()
    gathered = sharded_states(engine, comm)  # every rank, whatever the error: it is collective
    written: list[tuple[int, int, str]] = []  # (model stage, bytes, sha256)
    for k in (sorted(chunks(engine)) if engine.r == 0 and error is None else []):
        path = stage_file(d, k)
        try:
            d.mkdir(parents=True, exist_ok=True)
            payload = stage_payload(engine, step, run_info, k, None if gathered is None else gathered[k])
            written.append((k, *write_torch(path, payload, sweep=True)))
        except (OSError, RuntimeError) as e:  # RuntimeError: torch's writer failed without an OSError behind
            error = f"cannot write {path.name}: {reason(e)}"
            break
    results = comm.allgather((error, written, skipped))
    errors = [e for e, _, _ in results if e]
    if errors:
        raise CheckpointError(f"checkpoint of step {step} to {d} failed: {errors[0]}")
    if comm.Get_rank() == 0:
        sums = {s: (n, sha, skips) for _, w, skips in results for s, n, sha in w}
        stages = [{"file": stage_file(d, s).name, "layers": list(st.layers), "bytes": sums[s][0],
                   "sha256": sums[s][1], "skipped_in_a_row": sums[s][2][0], "skipped_in_all": sums[s][2][1]}
                  for s, st in enumerate(engine.plan.stages)]
        marker = {"format": CKPT_FORMAT, "step": step, "stages": stages, "run": run_info}
        try:
            write_json(d / MARKER, marker, sweep=True)
        except OSError as e:
            error = f"checkpoint of step {step} to {d} failed: cannot write {MARKER}: {e.strerror}"
    error = comm.bcast(error, root=0)
    if error:
        raise CheckpointError(error)
    return d


def run_info(args: TrainConfig, spec: Any, plan: Any) -> dict[str, Any]:
    """What a checkpoint records about its run; MUST_MATCH entries are checked on resume."""
    return {"model": spec.name, "model_args": spec.args, "num_layers": len(spec.layers), "seed": args.seed,
            "shuffle": not args.no_shuffle, "samples_per_step": plan.microbatches * args.microbatch_size,
            "microbatches": plan.microbatches, "microbatch_size": args.microbatch_size,
            "schedule": plan.schedule, "virtual_stages": plan.virtual_stages, "optimizer": args.optimizer,
            "dtype": args.dtype}
