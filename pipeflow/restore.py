"""Reading checkpoints back (checkpoint.py writes them): the complete steps of a directory, the files of a
step verified against its COMPLETE marker (size and sha256), a stage's weights, optimizer state and RNG loaded
per layer under any plan (one chunk per rank or several, interleaved)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from partitioner.jsonfile import Field, field_problem, load_json, show_repr
from pipeflow.checkpoint import (
    _STEP_RE,
    CKPT_FORMAT,
    MARKER,
    MUST_MATCH,
    CheckpointError,
    _layer,
    _param_names,
    chunk_layers,
    chunks,
    file_sha256,
)

log = logging.getLogger("pipeflow.checkpoint")  # the name these lines had before checkpoint.py was split

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
        marker = load_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint marker ({e}); expected JSON written by "
                              "pipeflow-train") from None
    found = _marker_problem(marker)
    if found:
        raise CheckpointError(f"{path}: not a {CKPT_FORMAT} marker: expected an object with format, step, run "
                              f"and stages [{{file, layers: [start, end), bytes, sha256}}]; found {found}")
    return marker


def _marker_problem(marker: Any) -> str | None:
    """What breaks the marker's format, as the end of "found ...": "format 'pipeflow.checkpoint/9' (a str)", "step
    '1' (a str)", "no 'run'", "stages[0].layers [1, 1] (a list)"; None when it holds."""
    if not isinstance(marker, dict):
        return f"a {type(marker).__name__}"
    if marker.get("format") != CKPT_FORMAT:
        return f"format {_shown(marker['format'])}" if "format" in marker else "no 'format'"
    for key, rule in MARKER_FIELDS.items():
        if key not in marker:
            return f"no {key!r}"
        if field_problem(marker, {key: rule}) is not None:
            return f"{key} {_shown(marker[key])}"
    if not marker["stages"]:
        return "stages []"
    for k, stage in enumerate(marker["stages"]):
        if not isinstance(stage, dict):
            return f"stages[{k}] {_shown(stage)}"
        for key, rule in MARKER_STAGE_FIELDS.items():
            if key not in stage and key in ("file", "layers"):  # the others: absent in older markers
                return f"stages[{k}] without {key!r}"
            if key in stage and field_problem(stage, {key: rule}) is not None:
                return f"stages[{k}].{key} {_shown(stage[key])}"
    return None


def _shown(value: Any) -> str:
    return f"{show_repr(value)} (a {type(value).__name__})"


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_range(x: Any) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(map(_is_count, x)) and x[0] < x[1]


def _overlaps(layers: list[int], spans: list[tuple[int, int]]) -> bool:  # layers [lo, hi) meet a span [a, b)
    return any(layers[0] < b and a < layers[1] for a, b in spans)


# The COMPLETE marker's fields (checkpoint.save writes them), checked by partitioner.jsonfile's one validator.
MARKER_FIELDS: dict[str, Field] = {"format": lambda f: f == CKPT_FORMAT, "step": int, "run": dict, "stages": list}
MARKER_STAGE_FIELDS: dict[str, Field] = {"file": lambda f: isinstance(f, str) and "/" not in f, "layers": _is_range,
                                         "bytes": int, "sha256": str, "skipped_in_a_row": _is_count,
                                         "skipped_in_all": _is_count}


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
    """Load this rank's layers (every chunk it holds) from step directory `d` into the engine; returns the
    step to go on from. The files are read per layer, so they may come from any plan, interleaved or not."""
    marker = marker or read_marker(d)
    check_run(marker, d, run_info)
    mine = chunks(engine)
    spans = [chunk_layers(c) for c in mine.values()]

    def here(layer: int) -> bool:
        return any(a <= layer < b for a, b in spans)

    weights: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    opt_classes: set[str] = set()
    same: dict[tuple[int, int], dict[str, Any]] = {}  # the files with exactly a chunk's layers
    files = []
    for st in marker["stages"]:
        lo, hi = st["layers"]
        if not _overlaps(st["layers"], spans):
            continue
        path = d / st["file"]
        obj = load_stage_file(path)
        if obj["step"] != marker["step"] or obj["layers"] != [lo, hi]:
            raise CheckpointError(f"{path}: holds step {obj['step']} layers {obj['layers']}, but {d / MARKER} "
                                  f"expects step {marker['step']} layers {[lo, hi]}: files of different checkpoints")
        files.append(path.name)
        weights.update({k: v for k, v in obj["weights"].items() if here(_layer(k))})
        states.update({k: v for k, v in obj["optimizer"]["state"].items() if here(_layer(k))})
        opt_classes.add(obj["optimizer"]["class"])
        if (lo, hi) in spans:
            same[(lo, hi)] = obj
    where = f"{d} ({', '.join(files) or 'no file'})"
    want = engine.state_dict()
    missing = [k for k in want if k not in weights]
    extra = [k for k in weights if k not in want]
    if missing or extra:
        layers = ", ".join(f"[{a}, {b})" for a, b in spans)
        raise CheckpointError(f"{where}: parameters do not match layers {layers} of this model: "
                              f"missing {missing[:5]}, unexpected {extra[:5]}")
    bad = [f"{k} {tuple(weights[k].shape)} vs {tuple(v.shape)}" for k, v in want.items()
           if weights[k].shape != v.shape]
    if bad:
        raise CheckpointError(f"{where}: shapes differ from this model's: {bad[:5]}")
    optimizer = type(engine.optimizer).__name__
    if opt_classes - {optimizer}:
        raise CheckpointError(f"{where}: written with optimizer {sorted(opt_classes)}, this run uses {optimizer}; "
                              "resume with the same --optimizer")
    for chunk in mine.values():
        a, b = chunk_layers(chunk)
        chunk.module.load_state_dict({f"{_layer(k) - a}.{k.partition('.')[2]}": v
                                      for k, v in weights.items() if a <= _layer(k) < b})
    _load_optimizer(engine, states)
    if len(same) == len(spans):  # every chunk as it was saved: the RNG in the file of the first one
        rng = same[chunk_layers(mine[min(mine)])]["rng"]
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and engine.world.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], engine.world.device)
    else:
        log.info("stage %d: the checkpoint splits the layers differently; RNG state starts "
                 "fresh (weights and optimizer state are restored per layer)", engine.s)
    return int(marker["step"])


def skipped(engine: Any, marker: dict[str, Any]) -> tuple[int, int]:
    """(steps skipped in a row, in all) up to the checkpoint (--skip-nonfinite), as its writers counted them: the most
    over the marker's stages holding this rank's layers (the same on every stage under flush schedules, which agree;
    a stage's own updates under async and 2bw). Markers without the counts (older versions) give 0."""
    spans = [chunk_layers(c) for c in chunks(engine).values()]
    mine = [st for st in marker["stages"] if _overlaps(st["layers"], spans)] or [{}]
    return max(st.get("skipped_in_a_row", 0) for st in mine), max(st.get("skipped_in_all", 0) for st in mine)


def _load_optimizer(engine: Any, states: dict[str, dict[str, Any]]) -> None:
    """Per-parameter state by name; hyperparameters stay this run's (the flags win)."""
    opt = engine.optimizer
    names = _param_names(engine)
    order = [p for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(order):  # a tied parameter: any of its names (their states are equal)
        found = [n for n in names.get(id(p), []) if n in states]  # none: a placeholder (update.py)
        if found:
            state[i] = states[found[0]]
    groups, i = [], 0
    for g in opt.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    opt.load_state_dict({"state": state, "param_groups": groups})
