"""When a checkpoint is saved: checkpoint.intervalSteps, or for "auto" the Young/Daly interval from the measured
save cost and the run's failure rate (kiln.trainer.checkpoint.checkpointer). A policy: it reads the
Checkpointer's stats and writes nothing of theirs."""

from __future__ import annotations

import math
import os
import time

from kiln.api.spec import CheckpointSpec
from kiln.trainer.checkpoint.stats import CheckpointStats

# intervalSteps: auto — bounds and priors (Young/Daly needs a cost and an MTBF before it has measured either).
AUTO_MIN_STEPS = 10
AUTO_MAX_STEPS = 10_000
AUTO_FIRST_STEPS = 10  # first save early, to measure its cost
MTBF_PRIOR_S = float(os.environ.get("KILN_MTBF_PRIOR_SECONDS", 6 * 3600))  # one failure per this, before evidence


def young_daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young/Daly optimal time between checkpoints: sqrt(2 x cost x MTBF), in seconds."""
    return (2.0 * max(save_cost_s, 0.0) * max(mtbf_s, 0.0)) ** 0.5


class CheckpointSchedule:
    """The save interval: the spec's steps, or Young/Daly's choice for intervalSteps: auto, from `stats` and the
    step time it measures itself."""

    def __init__(self, spec: CheckpointSpec, stats: CheckpointStats):
        self.spec, self.stats = spec, stats
        self.step_time_s: float | None = None  # moving average, from the steps should_save sees
        self._last_step_seen: tuple[int, float] | None = None

    @property
    def interval_steps(self) -> int:
        """The current save interval in steps (the spec's integer, or the Young/Daly choice for "auto")."""
        if self.spec.interval_steps != "auto":
            return int(self.spec.interval_steps)
        st = self.stats
        if st.last_saved_step is None or self.step_time_s is None or st.last_save_s == 0.0:
            return AUTO_FIRST_STEPS
        seconds = young_daly_interval(st.last_blocking_s + st.last_wait_s, self.mtbf_s)
        steps = math.ceil(seconds / max(self.step_time_s, 1e-6))
        # never closer than one background save takes, or saves would queue up behind each other
        floor = math.ceil(st.last_save_s / max(self.step_time_s, 1e-6))
        return int(min(AUTO_MAX_STEPS, max(AUTO_MIN_STEPS, floor, steps)))

    @property
    def mtbf_s(self) -> float:
        """Mean time between failures: the prior blended with the observed failures of this run."""
        return (self.stats.run_seconds + self.stats.elapsed() + MTBF_PRIOR_S) / (self.stats.failures + 1)

    def should_save(self, step: int) -> bool:
        now = time.monotonic()
        if self._last_step_seen is not None and step > self._last_step_seen[0]:
            dt = (now - self._last_step_seen[1]) / (step - self._last_step_seen[0])
            self.step_time_s = dt if self.step_time_s is None else 0.9 * self.step_time_s + 0.1 * dt
        self._last_step_seen = (step, now)
        if step <= 0:
            return False
        if self.spec.interval_steps == "auto":
            return step - (self.stats.last_saved_step or 0) >= self.interval_steps
        return step % int(self.spec.interval_steps) == 0
