"""The files pipeflow-plan and pipeflow-profile write (-o, --timeline), checked before the work that fills them: a
path that cannot be written is refused in one line naming its flag, not after minutes of profiling or planning."""
from __future__ import annotations

import os
from pathlib import Path


def check_output(path: str, flag: str, error: type[ValueError]) -> None:
    """`error` with one line unless `path` names a file that can be written: not empty, not a directory, in a
    directory that exists and takes new files (through a symbolic link: where its target is, as
    jsonfile.atomic_write writes it)."""
    if not path:
        raise error(f"{flag} must name a file, found ''")
    given = Path(path)
    target = Path(os.path.realpath(given)) if given.is_symlink() else given
    if target.is_dir():
        raise error(f"{flag} must name a file, found the directory {path}")
    parent = target.parent
    if not parent.exists():
        raise error(f"{flag} must be in an existing directory, found {path} ({parent} does not exist)")
    if not parent.is_dir():
        raise error(f"{flag} must be in a directory, found {path} ({parent} is not a directory)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"{flag} must be in a directory this user can write, found {path} ({parent} is not writable)")


def same_file(a: str, b: str) -> bool:
    """`a` and `b` name one file: the same path once links are resolved, or one file under two names (a hard
    link); False where either does not exist and the paths differ."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
