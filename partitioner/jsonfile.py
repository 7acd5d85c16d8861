"""JSON files (profile.json, plan.json, a checkpoint's COMPLETE marker): one reader with one clear error for an
unreadable, non-text or non-JSON file, one validator of an object's fields against a table (check_fields), and
one atomic writer, so that a reader sees the old file or the whole new one, never a part (a crash or a full disk
mid-write leaves the old file)."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import IO, Any

# What a field must hold: a type (or types; a JSON true/false is never an int), a predicate, or None: anything.
Field = type | tuple[type, ...] | Callable[[Any], bool] | None


# Valid JSON that Python's parser refuses, reported as a JSONDecodeError with these messages: it recurses once per
# level of nesting ('[' * 100000 raises RecursionError) and converts integers of at most 4300 digits (ValueError).
_TOO_DEEP = f"arrays or objects nested too deeply to read (at most about {sys.getrecursionlimit()} levels)"
_TOO_LONG = f"holds an integer of more than {sys.get_int_max_str_digits()} digits"


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError(_TOO_DEEP, text, 0) from None
    except ValueError:
        raise json.JSONDecodeError(_TOO_LONG, text, 0) from None


def load_json(path: str | Path) -> Any:
    """The parsed JSON of `path`, errors as raised (OSError, UnicodeDecodeError, json.JSONDecodeError, also for
    a file nested too deeply or holding too long an integer): for readers that word their own message (the
    checkpoint marker, the --checkpoint-dir lock file)."""
    return _parse(Path(path).read_text())


def read_json(path: str | Path, what: str, error: type[ValueError]) -> Any:
    """The parsed JSON of `path`; `error(message)` names the file and what `what` (e.g. 'plan.json') expected."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise error(f"cannot read {what.split('.')[0]} {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a text file ({e.reason} at byte {e.start}); expected {what}") from None
    try:
        return _parse(text)
    except json.JSONDecodeError as e:
        if e.msg in (_TOO_DEEP, _TOO_LONG):
            raise error(f"{path}: {e.msg}; expected {what}") from None
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def show(v: Any, *, write: Callable[[Any], str] = json.dumps) -> str:
    """A value as it appears in JSON (or as `write`, e.g. repr, writes it), cut short: for messages that print
    what a file held (1e400, a list of thousands, a value nested a thousand levels deep)."""
    try:
        try:
            text = write(v)
        except (TypeError, ValueError):  # not JSON: as Python writes it
            text = repr(v)
    except RecursionError:
        text = "(a value nested too deeply to show)"
    return text if len(text) <= 60 else text[:57] + "..."


def show_repr(v: Any) -> str:
    """A value as Python writes it ('fused', [2]), cut short as show() cuts it."""
    return show(v, write=repr)


def _accepts(rule: Field, value: Any) -> bool:
    if rule is None:
        return True
    if isinstance(rule, (type, tuple)):
        return isinstance(value, rule) and not isinstance(value, bool)
    return bool(rule(value))


def field_problem(d: Mapping[str, Any], fields: Mapping[str, Field], *, optional: Collection[str] = (),
                  show: Callable[[Any], str] = show_repr) -> str | None:
    """The first field of `d` that breaks the table `fields`, as "missing field 'k'" or "field 'k' must be
    int, found 'x'" (`show` writes the value), or None when all hold; `optional` fields may be absent."""
    for key, rule in fields.items():
        if key not in d:
            if key in optional:
                continue
            return f"missing field {key!r}"
        if not _accepts(rule, d[key]):
            name = (rule.__name__ if isinstance(rule, type) else "/".join(t.__name__ for t in rule)
                    if isinstance(rule, tuple) else "valid")
            return f"field {key!r} must be {name}, found {show(d[key])}"
    return None


def check_fields(d: Any, fields: Mapping[str, Field], *, source: str, error: type[ValueError],
                 format: str | None = None, show: Callable[[Any], str] = show_repr) -> dict[str, Any]:
    """`d` as a JSON object whose "format" is `format` (when given) and whose fields hold the table `fields`;
    otherwise `error` with one line: "{source}: expected a JSON object, found list", "{source}: format is
    'x', expected 'pipeflow.plan/1'", "{source}: missing field 'k'", "{source}: field 'k' must be int, found 'x'"."""
    if not isinstance(d, dict):
        raise error(f"{source}: expected a JSON object, found {type(d).__name__}")
    if format is not None and d.get("format") != format:
        raise error(f"{source}: format is {show(d.get('format'))}, expected {format!r}")
    problem = field_problem(d, fields, show=show)
    if problem is not None:
        raise error(f"{source}: {problem}")
    return d


def _temporary_prefix(path: Path) -> str:
    """atomic_write's temporary file of `path` is this and the writer's pid, beside it: `.plan.json.tmp-4242`."""
    return f".{path.name}.tmp-"


def remove_leftovers(path: Path) -> None:
    """Remove the temporary files of `path` (`.NAME.tmp-PID`, atomic_write's) that processes killed while writing it
    left behind (kill -9: no handler to remove them): each is as large as the file. Only for a file that one process
    writes at a time (a checkpoint's, under its directory's lock): another's temporary file would be in use. A file
    that cannot be removed stays, unreported: it does not stop the write."""
    prefix = _temporary_prefix(path)
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return
    for p in entries:
        if p.name.startswith(prefix) and p.name[len(prefix):].isdigit():
            with contextlib.suppress(OSError):
                p.unlink()


def atomic_write(path: Path, write: Callable[[IO[bytes]], object], *, sweep: bool = False) -> None:
    """Temporary file in the same directory, fsync, rename over `path`, fsync the directory: a reader
    sees the old file or the whole new one, never a part. A symbolic link is written through: its
    target is replaced, the link stays. `sweep`: first remove the temporary files of `path` that other
    processes left (remove_leftovers)."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if sweep:
        remove_leftovers(path)
    tmp = path.with_name(f"{_temporary_prefix(path)}{os.getpid()}")
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


def write_json(path: str | Path, value: Any, *, sweep: bool = False) -> None:
    """`value` as indented JSON and a newline, written atomically (atomic_write, `sweep` as there). An OSError names
    `path` itself, not the temporary file: "[Errno 2] No such file or directory: 'out/plan.json'"."""
    text = json.dumps(value, indent=1) + "\n"
    try:
        atomic_write(Path(path), lambda f: f.write(text.encode()), sweep=sweep)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
