"""Checkpoints stored per layer (model-wide keys): atomic per-stage files, a COMPLETE marker, resume.

    D/step-000005/stage-000.pt   weights, optimizer state, RNG, policy extra state of stage 0
    D/step-000005/stage-001.pt
    D/step-000005/COMPLETE       JSON written by rank 0 once every stage confirmed its file, with each
                                 file's size and sha256, so that a resume can verify them exactly

Weights use the keys of nn.Sequential(*spec.layers) ("3.fc.weight") and optimizer state is keyed by
the same parameter names, so a checkpoint resumes under any plan or number of workers. The data
position is the step: the sample order is a pure function of the seed and the step (data/loader.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

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


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Temporary file in the same directory, fsync, rename over `path`, fsync the directory: a reader
    sees the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _param_names(engine: Any) -> dict[int, list[str]]:
    """id(parameter) -> its model-wide names ("3.fc.weight"): several for a Parameter that layers share
    (tied weights), whose optimizer state is then written under each, as its weight is."""
    out: dict[int, list[str]] = {}
    for k, p in engine.stage.module.named_parameters(remove_duplicate=False):
        idx, _, rest = k.partition(".")
        out.setdefault(id(p), []).append(f"{int(idx) + engine.stage.start}.{rest}")
    return out


def optimizer_state(engine: Any) -> dict[str, Any]:
    """torch's optimizer state_dict with parameter indices replaced by model-wide parameter names."""
    opt = engine.optimizer
    names = _param_names(engine)
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    sd = opt.state_dict()
    state = {name: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in sd["state"].items() for name in order[i]}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [order[i][0] for i in g["params"]]}
              for g in sd["param_groups"]]
    return {"class": type(opt).__name__, "state": state, "groups": groups}


def stage_payload(engine: Any, step: int, run_info: dict[str, Any]) -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if engine.world.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(engine.world.device)
    extra_state = getattr(engine.policy, "extra_state", None)
    return {"format": CKPT_FORMAT, "step": step, "stage": engine.s,
            "layers": [engine.stage.start, engine.stage.start + len(engine.stage.module)],
            "weights": {k: v.clone() for k, v in engine.state_dict().items()},
            "optimizer": optimizer_state(engine), "rng": rng,
            "extra": extra_state() if callable(extra_state) else None, "run": run_info}


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


def write_torch(path: Path, obj: Any) -> tuple[int, str]:
    """torch.save `obj` to `path` atomically; returns (bytes, sha256 hex). A failed write raises its OSError
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

    atomic_write(path, write)
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


def save(engine: Any, root: str | Path, step: int, comm: Any, run_info: dict[str, Any]) -> Path:
    """Collective: replica 0 of every stage writes its file; rank 0 writes COMPLETE, with every file's size and
    sha256, once all confirmed. A failure on any rank raises CheckpointError on every rank ("checkpoint of step
    5 to D/step-000005 failed: ...: No space left on device"), the step left without its marker."""
    d = step_dir(root, step)
    error: str | None = None
    if comm.Get_rank() == 0:
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / MARKER).unlink(missing_ok=True)  # rewriting a step: incomplete until every file is new
        except OSError as e:
            error = f"cannot create the directory: {e.strerror}"
    comm.Barrier()
    written: tuple[int, int, str] | None = None  # (stage, bytes, sha256)
    if engine.r == 0 and error is None:
        path = stage_file(d, engine.s)
        try:
            d.mkdir(parents=True, exist_ok=True)
            payload = stage_payload(engine, step, run_info)
            written = (engine.s, *write_torch(path, payload))
        except (OSError, RuntimeError) as e:  # RuntimeError: torch's writer failed without an OSError behind
            error = f"cannot write {path.name}: {reason(e)}"
    results = comm.allgather((error, written))
    errors = [e for e, _ in results if e]
    if errors:
        raise CheckpointError(f"checkpoint of step {step} to {d} failed: {errors[0]}")
    if comm.Get_rank() == 0:
        sums = {s: (n, sha) for _, w in results if w is not None for s, n, sha in [w]}
        stages = [{"file": stage_file(d, s).name, "layers": list(st.layers), "bytes": sums[s][0],
                   "sha256": sums[s][1]} for s, st in enumerate(engine.plan.stages)]
        marker = {"format": CKPT_FORMAT, "step": step, "stages": stages, "run": run_info}
        try:
            atomic_write(d / MARKER, lambda f: f.write((json.dumps(marker, indent=1) + "\n").encode()))
        except OSError as e:
            error = f"checkpoint of step {step} to {d} failed: cannot write {MARKER}: {e.strerror}"
    error = comm.bcast(error, root=0)
    if error:
        raise CheckpointError(error)
    return d


# ---------------------------------------------------------------------------------------- finding


def complete_steps(root: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of the complete checkpoints under root, oldest first."""
    out = []
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return []
    for d in entries:
        m = _STEP_RE.match(d.name)
        if m and (d / MARKER).is_file():
            out.append((int(m.group(1)), d))
    return sorted(out)


def candidates(resume: str, checkpoint_dir: str | None) -> list[Path]:
    """The step directories to try resuming from, best first: `resume` is "latest" (the complete ones in
    --checkpoint-dir, newest first; none yet: empty) or a path: a step directory (that one only) or a
    directory of them (its complete ones, newest first)."""
    if resume == "latest":
        if not checkpoint_dir:
            raise CheckpointError("--resume without a path needs --checkpoint-dir (where to look for the latest)")
        return [d for _, d in reversed(complete_steps(checkpoint_dir))]
    p = Path(resume)
    if (p / MARKER).is_file():
        return [p]
    if not p.exists():
        raise CheckpointError(f"--resume {resume}: no such file or directory")
    if p.is_file():
        raise CheckpointError(f"--resume {resume}: expected a checkpoint step directory (step-NNNNNN/ with a "
                              f"{MARKER} marker) or a --checkpoint-dir, found a file")
    if _STEP_RE.match(p.name):
        raise CheckpointError(f"--resume {resume}: this checkpoint is incomplete (no {MARKER} marker: the run "
                              "stopped while writing it); resume from an earlier step or the directory above")
    found = complete_steps(p)
    if not found:
        raise CheckpointError(f"--resume {resume}: no complete checkpoint (step-NNNNNN/ with {MARKER}) in it")
    return [d for _, d in reversed(found)]


def resolve(resume: str, checkpoint_dir: str | None) -> Path | None:
    """The newest of `candidates` (None: no checkpoint in --checkpoint-dir yet)."""
    found = candidates(resume, checkpoint_dir)
    return found[0] if found else None


def verify(d: Path, marker: dict[str, Any], stages: range | list[int]) -> list[str]:
    """What is wrong with the files of `stages` (indices into the marker's list) of step directory `d`: missing,
    another size, or another sha256 than the marker recorded. Markers without sizes and checksums (written
    before they were recorded) verify by presence only."""
    problems = []
    for i in stages:
        st = marker["stages"][i]
        path = d / st["file"]
        try:
            size = path.stat().st_size
        except OSError as e:
            problems.append(f"{path} is missing" if isinstance(e, FileNotFoundError) else f"{path}: {e.strerror}")
            continue
        if "bytes" in st and size != st["bytes"]:
            problems.append(f"{path} is truncated or overwritten ({size} bytes, {MARKER} says {st['bytes']})")
        elif "sha256" in st:
            try:
                ok = file_sha256(path) == st["sha256"]
            except OSError as e:
                problems.append(f"{path}: {e.strerror}")
                continue
            if not ok:
                problems.append(f"{path} is corrupt (its sha256 differs from the one in {MARKER})")
    return problems


def read_marker(d: Path) -> dict[str, Any]:
    path = d / MARKER
    try:
        marker = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint marker ({e}); expected JSON written by "
                              "pipeflow-train") from None
    ok = (isinstance(marker, dict) and marker.get("format") == CKPT_FORMAT
          and isinstance(marker.get("step"), int) and isinstance(marker.get("run"), dict)
          and isinstance(marker.get("stages"), list) and marker["stages"]
          and all(isinstance(s, dict) and isinstance(s.get("file"), str) and "/" not in s["file"]
                  and _is_range(s.get("layers")) and isinstance(s.get("bytes", 0), int)
                  and isinstance(s.get("sha256", ""), str) for s in marker["stages"]))
    if not ok:
        raise CheckpointError(f"{path}: not a {CKPT_FORMAT} marker: expected an object with format, step, run "
                              "and stages [{file, layers: [start, end), bytes, sha256}]")
    return marker


def _is_range(x: Any) -> bool:
    return (isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in x)
            and 0 <= x[0] < x[1])


# ---------------------------------------------------------------------------------------- reading


def load_stage_file(path: Path) -> dict[str, Any]:
    """One stage file, loaded with weights_only=True and checked field by field."""
    expected = f"a {CKPT_FORMAT} stage file written by pipeflow-train --checkpoint-dir"
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing, but the {MARKER} marker lists it") from None
    except Exception as e:  # truncated zip, foreign pickle, disallowed globals: all mean "not ours"
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise CheckpointError(f"{path}: cannot load it ({type(e).__name__}: {first}); expected {expected}. "
                              "The file may be truncated or not a pipeflow checkpoint") from None
    if not isinstance(obj, dict) or obj.get("format") != CKPT_FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{path}: foreign file (format {found!r}); expected {expected}")
    problems = []
    if not isinstance(obj.get("step"), int) or not isinstance(obj.get("stage"), int):
        problems.append("step and stage must be integers")
    if not _is_range(obj.get("layers")):
        problems.append("layers must be [start, end)")
    w = obj.get("weights")
    if not isinstance(w, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in w.items()):
        problems.append("weights must map parameter names to tensors")
    opt = obj.get("optimizer")
    if not (isinstance(opt, dict) and isinstance(opt.get("class"), str) and isinstance(opt.get("state"), dict)
            and all(isinstance(v, dict) for v in opt["state"].values()) and isinstance(opt.get("groups"), list)):
        problems.append("optimizer must hold class, state (per parameter name) and groups")
    if not isinstance(obj.get("rng"), dict) or not isinstance(obj.get("run"), dict):
        problems.append("rng and run must be objects")
    if problems:
        raise CheckpointError(f"{path}: malformed checkpoint ({'; '.join(problems)}); expected {expected}")
    return obj


def check_run(marker: dict[str, Any], d: Path, run_info: dict[str, Any]) -> None:
    saved = marker["run"]
    if saved.get("num_layers") != run_info["num_layers"]:
        raise CheckpointError(f"{d}: written for a model of {saved.get('num_layers')} layers "
                              f"({saved.get('model')} {json.dumps(saved.get('model_args'))}); this run's model has "
                              f"{run_info['num_layers']} ({run_info['model']} {json.dumps(run_info['model_args'])})")
    diff = [f"{k} {saved.get(k)!r} -> {run_info[k]!r}" for k in MUST_MATCH if saved.get(k) != run_info[k]]
    if diff:
        raise CheckpointError(f"{d}: this run would read other samples than the checkpointed one ({', '.join(diff)}); "
                              "resume with the same --seed, --no-shuffle and microbatches x microbatch size")


def load(engine: Any, d: Path, run_info: dict[str, Any], marker: dict[str, Any] | None = None) -> int:
    """Load this rank's layers from step directory `d` into the engine; returns the step to go on from."""
    marker = marker or read_marker(d)
    check_run(marker, d, run_info)
    a, b = engine.stage.start, engine.stage.start + len(engine.stage.module)
    weights: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    opt_classes: set[str] = set()
    same_stage: dict[str, Any] | None = None
    files = []
    for st in marker["stages"]:
        lo, hi = st["layers"]
        if hi <= a or lo >= b:
            continue
        path = d / st["file"]
        obj = load_stage_file(path)
        if obj["step"] != marker["step"] or obj["layers"] != [lo, hi]:
            raise CheckpointError(f"{path}: holds step {obj['step']} layers {obj['layers']}, but {d / MARKER} "
                                  f"expects step {marker['step']} layers {[lo, hi]}: files of different checkpoints")
        files.append(path.name)
        weights.update({k: v for k, v in obj["weights"].items() if a <= _layer(k) < b})
        states.update({k: v for k, v in obj["optimizer"]["state"].items() if a <= _layer(k) < b})
        opt_classes.add(obj["optimizer"]["class"])
        if [lo, hi] == [a, b]:
            same_stage = obj
    where = f"{d} ({', '.join(files) or 'no file'})"
    want = engine.state_dict()
    missing = [k for k in want if k not in weights]
    extra = [k for k in weights if k not in want]
    if missing or extra:
        raise CheckpointError(f"{where}: parameters do not match layers [{a}, {b}) of this model: "
                              f"missing {missing[:5]}, unexpected {extra[:5]}")
    bad = [f"{k} {tuple(weights[k].shape)} vs {tuple(v.shape)}" for k, v in want.items()
           if weights[k].shape != v.shape]
    if bad:
        raise CheckpointError(f"{where}: shapes differ from this model's: {bad[:5]}")
    mine = type(engine.optimizer).__name__
    if opt_classes - {mine}:
        raise CheckpointError(f"{where}: written with optimizer {sorted(opt_classes)}, this run uses {mine}; "
                              "resume with the same --optimizer")
    start = engine.stage.start
    engine.stage.module.load_state_dict({f"{int(k.partition('.')[0]) - start}.{k.partition('.')[2]}": v
                                         for k, v in weights.items()})
    _load_optimizer(engine, states)
    if same_stage is not None:
        torch.set_rng_state(same_stage["rng"]["torch"])
        if "cuda" in same_stage["rng"] and engine.world.device.type == "cuda":
            torch.cuda.set_rng_state(same_stage["rng"]["cuda"], engine.world.device)
        load_extra = getattr(engine.policy, "load_extra_state", None)
        if callable(load_extra) and same_stage.get("extra") is not None:
            load_extra(same_stage["extra"])
    else:
        log.info("stage %d: the checkpoint splits the layers differently; RNG and weight-policy state start "
                 "fresh (weights and optimizer state are restored per layer)", engine.s)
    return int(marker["step"])


def _layer(key: str) -> int:
    head = key.partition(".")[0]
    return int(head) if head.isdigit() else -1


def _load_optimizer(engine: Any, states: dict[str, dict[str, Any]]) -> None:
    """Per-parameter state by name; hyperparameters stay this run's (the flags win)."""
    opt = engine.optimizer
    names = _param_names(engine)
    order = [p for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(order):  # a tied parameter: any of its names (their states are equal)
        found = [n for n in names[id(p)] if n in states]
        if found:
            state[i] = states[found[0]]
    groups, i = [], 0
    for g in opt.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    opt.load_state_dict({"state": state, "param_groups": groups})


def run_info(args: Any, spec: Any, plan: Any) -> dict[str, Any]:
    """What a checkpoint records about its run; MUST_MATCH entries are checked on resume."""
    return {"model": spec.name, "model_args": spec.args, "num_layers": len(spec.layers), "seed": args.seed,
            "shuffle": not args.no_shuffle, "samples_per_step": plan.microbatches * args.microbatch_size,
            "microbatches": plan.microbatches, "microbatch_size": args.microbatch_size,
            "schedule": plan.schedule, "optimizer": args.optimizer, "dtype": args.dtype}
