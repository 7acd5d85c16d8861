"""Choosing the checkpoint to resume from: the newest complete one whose files verify against its marker."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeflow import restore
from pipeflow.checkpoint import CheckpointError

log = logging.getLogger(__name__)


def choose(comm: Any, resume: str, checkpoint_dir: str | None) -> tuple[Path | None, dict[str, Any] | None]:
    """Collective: (step directory, marker) to resume from, or (None, None) when --checkpoint-dir holds no
    complete checkpoint yet. Rank 0 lists the candidates and reads each marker; the ranks verify the stage
    files between them (sizes and sha256, restore.verify). A candidate that fails is named in one warning
    with the one used instead; raises CheckpointError on every rank when none verifies."""
    rank, size = comm.Get_rank(), comm.Get_size()
    found: tuple[list[str], str | None] = ([], None)
    if rank == 0:  # one rank lists them, so that all try the same ones
        try:
            found = ([str(d) for d in restore.candidates(resume, checkpoint_dir)], None)
        except CheckpointError as e:
            found = ([], str(e))
    paths, error = comm.bcast(found, root=0)
    if error:
        raise CheckpointError(error)
    skipped: list[str] = []
    for path in paths:
        d = Path(path)
        got: tuple[dict[str, Any] | None, str | None] = (None, None)
        if rank == 0:
            try:
                got = (restore.read_marker(d), None)
            except CheckpointError as e:
                got = (None, str(e))
        marker, bad = comm.bcast(got, root=0)
        problems = [bad] if bad else []
        if marker is not None:
            mine = restore.verify(d, marker, range(rank, len(marker["stages"]), size))
            problems = [p for theirs in comm.allgather(mine) for p in theirs]
        if not problems:
            if skipped and rank == 0:
                log.warning("--resume: %s; resuming from %s instead, the newest checkpoint that verifies",
                            "; ".join(skipped), d)
            return d, marker
        skipped += problems
    if not skipped:
        return None, None
    if len(paths) == 1 and resume != "latest" and Path(resume) == Path(paths[0]):
        raise CheckpointError(f"--resume {resume}: {'; '.join(skipped)}; resume from an earlier step, or from the "
                              "directory above to take the newest checkpoint that verifies")
    where = checkpoint_dir if resume == "latest" else resume
    raise CheckpointError(f"--resume: no checkpoint in {where} verifies: {'; '.join(skipped)}")
