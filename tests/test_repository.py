"""The repository stands alone: no tracked file points at documents outside it (the team's shared pages
next to the checkout); the user documentation lives in docs/ and every page it links exists."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Written in pieces so that this file does not match itself.
OUTSIDE = re.compile("|".join(re.escape(s) for s in ("../" + "shared", "shared/" + "tools", "DESIGN" + ".md",
                                                      "STYLE" + ".md", "IDEAS" + ".md")))
DOCS = ("formats.md", "schedules.md", "reproducibility.md", "failures.md", "api.md", "calibration.md")


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_tracked_file_points_outside_the_repository():
    hits = []
    for path in tracked_files():
        try:
            text = path.read_text(errors="ignore")
        except (IsADirectoryError, FileNotFoundError):  # a submodule, or deleted but not yet staged
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "point at docs/ instead:\n" + "\n".join(hits)


def test_docs_exist_and_their_links_resolve():
    pages = [ROOT / "README.md", *(ROOT / "docs" / name for name in DOCS)]
    for page in pages:
        assert page.is_file(), page
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
    readme = (ROOT / "README.md").read_text()
    assert all(f"docs/{name}" in readme for name in DOCS), "the README links every docs/ page"
