"""Reading profile.json / plan.json: one clear error for an unreadable, non-text or non-JSON file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path, what: str, error: type[ValueError]) -> Any:
    """The parsed JSON of `path`; `error(message)` names the file and what `what` (e.g. 'plan.json') expected."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise error(f"cannot read {what.split('.')[0]} {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a text file ({e.reason} at byte {e.start}); expected {what}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
