"""On/off switches read from the environment (CUPOOL_SKIP_PLAN, CUPOOL_PREFILL_AHEAD)."""

from __future__ import annotations


def parse_switch(name: str, text: str | None, default: bool, what: str) -> bool:
    """The value `text` of the on/off variable `name` (None: unset, giving `default`): "1" on,
    "0" off; anything else raises ValueError naming the variable (`what`: what "1" does)."""
    if text is None:
        return default
    if text in ("0", "1"):
        return text == "1"
    raise ValueError(f"{name}={text!r}: expected 1 ({what}) or 0")
