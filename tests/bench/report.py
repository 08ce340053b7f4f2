"""One way every benchmark writes its result: JSON at --out (folders made), a summary on stdout."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(result: dict, out: str | Path, *, summary: dict | None = None) -> Path:
    """Write `result` as JSON to `out`; print `summary` (default: the result itself) for the person running it."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result if summary is None else summary, indent=2))
    return path
