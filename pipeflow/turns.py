"""Several process groups that one point-to-point channel uses in turn (pipeflow/links.py decides how many)."""
from __future__ import annotations

from typing import Any


class Turns:
    """The k-th message of a channel goes through group k mod n, on both ends: each end counts the channel's
    messages, and both post them in the channel's order (the only order in which a group could match them)."""

    def __init__(self, groups: list[Any]) -> None:
        self.groups = groups
        self.count = 0

    def take(self) -> Any:
        group = self.groups[self.count % len(self.groups)]
        self.count += 1
        return group
