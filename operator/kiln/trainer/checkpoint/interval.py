"""How often a checkpoint is saved: checkpoint.intervalSteps, or for "auto" the Young/Daly interval
from the measured save cost and the run's failure rate (kiln.trainer.checkpoint.checkpointer)."""

from __future__ import annotations

import math
import os
import time

from kiln.storage.commit import young_daly_interval

# intervalSteps: auto — bounds and priors (Young/Daly needs a cost and an MTBF before it has measured either).
AUTO_MIN_STEPS = 10
AUTO_MAX_STEPS = 10_000
AUTO_FIRST_STEPS = 10  # first save early, to measure its cost
MTBF_PRIOR_S = float(os.environ.get("KILN_MTBF_PRIOR_SECONDS", 6 * 3600))  # one failure per this, before evidence


class CheckpointInterval:
    """Checkpointer's save interval: the spec's steps, or Young/Daly's choice for intervalSteps: auto."""

    @property
    def interval_steps(self) -> int:
        """The current save interval in steps (the spec's integer, or the Young/Daly choice for "auto")."""
        if self.spec.interval_steps != "auto":
            return int(self.spec.interval_steps)
        if self.last_saved_step is None or self._step_time_s is None or self.last_save_s == 0.0:
            return AUTO_FIRST_STEPS
        cost = self.last_blocking_s + self.last_wait_s
        seconds = young_daly_interval(cost, self.mtbf_s)
        steps = math.ceil(seconds / max(self._step_time_s, 1e-6))
        # never closer than one background save takes, or saves would queue up behind each other
        floor = math.ceil(self.last_save_s / max(self._step_time_s, 1e-6))
        return int(min(AUTO_MAX_STEPS, max(AUTO_MIN_STEPS, floor, steps)))

    @property
    def mtbf_s(self) -> float:
        """Mean time between failures: the prior blended with the observed failures of this run."""
        return (self._run_seconds + self._elapsed() + MTBF_PRIOR_S) / (self._failures + 1)

    def _elapsed(self) -> float:
        return time.monotonic() - self._started

    def should_save(self, step: int) -> bool:
        now = time.monotonic()
        if self._last_step_seen is not None and step > self._last_step_seen[0]:
            dt = (now - self._last_step_seen[1]) / (step - self._last_step_seen[0])
            self._step_time_s = dt if self._step_time_s is None else 0.9 * self._step_time_s + 0.1 * dt
        self._last_step_seen = (step, now)
        if step <= 0:
            return False
        if self.spec.interval_steps == "auto":
            return step - (self.last_saved_step or 0) >= self.interval_steps
        return step % int(self.spec.interval_steps) == 0
