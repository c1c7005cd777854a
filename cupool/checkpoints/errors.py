"""The one error checkpoint readers raise, and the JSON loading every reader shares."""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint cupool cannot read or serve; the message names the file or tensor and the
    values involved."""


def load_json(path: Path) -> dict:
    """A JSON object from `path`; CheckpointError naming the file when it is unreadable, not JSON
    or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
