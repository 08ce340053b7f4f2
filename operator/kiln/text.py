"""Small text formats shared by the CLI and the trainer (a leaf: imports nothing of kiln)."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """The largest whole unit: 45s, 3m, 2h, 5d (negative ages, from skewed clocks, read as 0s)."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
