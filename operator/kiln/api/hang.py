"""The hang rule, shared by the operator (kiln.control.elastic_sync: a run-wide restart) and the trainer (a replica
group's own watch, kiln.trainer.membership.hang_watch): a leaf of kiln.api, so neither imports the other.
Pure: step times and times in, a reason or None out."""

from __future__ import annotations

import math
from typing import Iterable


def p99(values: Iterable[float]) -> float:
    """Nearest-rank 99th percentile."""
    xs = sorted(values)
    if not xs:
        raise ValueError("p99 of no values")
    return xs[max(0, math.ceil(0.99 * len(xs)) - 1)]


HANG_FACTOR = 10.0  # no step for this many x p99 step time is a hang ...
HANG_FLOOR_S = 60.0  # ... but never under this: a save or a GC pause of very fast steps is not one
HANG_MIN_SAMPLES = 5  # step times before any verdict


def hang(recent_step_s: Iterable[float], last_progress: float, now: float, *, factor: float = HANG_FACTOR,
         floor_s: float = HANG_FLOOR_S, min_samples: int = HANG_MIN_SAMPLES) -> str | None:
    """A reason to restart when no step completed for factor x p99(recent step times), else None.

    Before `min_samples` step times exist (start-up, compile, restore) there is no baseline: no verdict.
    The floor keeps very fast steps from turning a checkpoint save or a GC pause into a "hang".
    """
    xs = list(recent_step_s)
    if len(xs) < min_samples:
        return None
    limit = max(factor * p99(xs), floor_s)
    idle = now - last_progress
    if idle > limit:
        return (f"no training step completed for {idle:.0f}s (limit {limit:.0f}s = max({factor:g} x p99 step time "
                f"{p99(xs):.2f}s, {floor_s:.0f}s)); restarting from the last checkpoint")
    return None
