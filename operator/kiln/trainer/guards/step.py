"""Step verdicts: skip or roll back a step whose global loss or gradient norm is NaN/Inf or a spike
(the package docstring, kiln.trainer.guards, shows where the loop calls them)."""

from __future__ import annotations

import enum
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

# torch is imported lazily: StepGuard and the decisions are used by code (and tests) without torch.

log = logging.getLogger("kiln.guards")


class Action(enum.Enum):
    OK = "ok"
    SKIP = "skip"  # drop this step's gradients, do not update
    ROLLBACK = "rollback"  # reload the last committed checkpoint and skip the offending data


@dataclass(frozen=True)
class Decision:
    action: Action
    step: int
    reason: str = ""
    zscore: float | None = None
    # For ROLLBACK: the inclusive range of training steps whose data is to be skipped after the reload.
    skip_data: tuple[int, int] | None = None


@dataclass(frozen=True)
class GuardConfig:
    """Thresholds; defaults follow common practice (OLMo/PaLM-style spike handling)."""

    window: int = 64  # recent accepted losses the robust z-score is computed over
    min_history: int = 8  # no spike verdict before this many accepted losses
    z_threshold: float = 6.0  # robust z above this (loss above the median) is a spike
    spike_limit: int = 3  # this many spikes ...
    spike_window: int = 50  # ... within this many steps → roll back
    rel_floor: float = 1e-3  # MAD floor relative to the median, so a flat loss does not make every wiggle a spike

    def __post_init__(self) -> None:
        if self.window < 2 or self.min_history < 2 or self.min_history > self.window:
            raise ValueError(f"guards: need 2 <= min_history ({self.min_history}) <= window ({self.window})")
        if self.z_threshold <= 0 or self.spike_limit < 1 or self.spike_window < 1:
            raise ValueError("guards: z_threshold must be > 0, spike_limit and spike_window >= 1")


def robust_zscore(value: float, history: Iterable[float], rel_floor: float = 1e-3, share: float = 1.0,
                  shares: Iterable[float] | None = None) -> float:
    """Modified z-score (Iglewicz & Hoaglin): 0.6745 (x - median) / MAD, with a floor on the MAD.

    `share`: the fraction of the global batch `value` was averaged over (replica groups: live groups / groups),
    `shares` the same for each past loss (1.0 when None). The spread is taken in full-batch units (each past
    deviation × √its share: the noise of a mean shrinks as √batch) and the deviation of `value` is weighted by
    its share: one odd sequence moves the mean of a half batch twice as far, while that batch's noise grows
    only √2, so its z is √2 higher than at full batch. Weighted so, the same sequence scores the same z at any
    share; a shift of the whole batch must be 1/share as large to score as high. At share 1 everywhere this is
    the plain modified z-score."""
    values = list(history)
    weights = [1.0] * len(values) if shares is None else [math.sqrt(s) for s in shares]
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) * w for v, w in zip(values, weights))
    mad = max(mad, rel_floor * abs(med), 1e-12)
    return 0.6745 * (value - med) * share / mad


@dataclass
class GuardCounters:
    skipped_nonfinite: int = 0
    skipped_spike: int = 0
    rollbacks: int = 0
    last_zscore: float = 0.0


MAX_SKIPPED_WINDOWS = 100  # bounds trainer.json; rollbacks are rare


class StepGuard:
    """Decides OK / SKIP / ROLLBACK for one optimizer step from the global loss and grad norm."""

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.config = config or GuardConfig()
        self.history: deque[float] = deque(maxlen=self.config.window)
        self.shares: deque[float] = deque(maxlen=self.config.window)  # each history loss's share of the batch
        self.spikes: deque[int] = deque()
        self.counters = GuardCounters()
        # Data windows (first, last step) skipped by rollbacks, newest last: kept in the checkpoint as a record
        # of which data the run never learned from.
        self.skipped_data: list[tuple[int, int]] = []

    def check(self, step: int, loss: float, grad_norm: float | None = None, share: float = 1.0) -> Decision:
        """`share`: the fraction of the global batch this step's loss averages (below 1 while only some
        replica groups are live); such a loss is noisier and is judged in full-batch units (robust_zscore)."""
        cfg = self.config
        if not 0.0 < share < math.inf:  # above 1 only if more groups joined than the spec names: a larger batch
            raise ValueError(f"guards: a step's share of the global batch must be positive and finite, got {share}")
        loss = float(loss)
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(float(grad_norm))):
            self.counters.skipped_nonfinite += 1
            what = "loss" if not math.isfinite(loss) else "grad norm"
            value = loss if what == "loss" else grad_norm
            return Decision(Action.SKIP, step, f"non-finite {what} ({value}) at step {step}")

        z = robust_zscore(loss, self.history, cfg.rel_floor, share, self.shares) \
            if len(self.history) >= cfg.min_history else 0.0
        self.counters.last_zscore = z
        if z <= cfg.z_threshold:
            self.history.append(loss)  # only accepted losses shape the baseline
            self.shares.append(share)
            return Decision(Action.OK, step, zscore=z)

        self.spikes.append(step)
        while self.spikes and self.spikes[0] <= step - cfg.spike_window:
            self.spikes.popleft()
        if len(self.spikes) >= cfg.spike_limit:
            first = self.spikes[0]
            self.spikes.clear()
            self.counters.rollbacks += 1
            self.skipped_data = [*self.skipped_data, (first, step)][-MAX_SKIPPED_WINDOWS:]
            return Decision(
                Action.ROLLBACK, step,
                f"{cfg.spike_limit} loss spikes within {cfg.spike_window} steps (steps {first}..{step}, "
                f"last z={z:.1f}); roll back to the last commit and skip data of steps {first}..{step}",
                zscore=z, skip_data=(first, step),
            )
        self.counters.skipped_spike += 1
        return Decision(Action.SKIP, step, f"loss spike {loss:.4g} (robust z={z:.1f} > {cfg.z_threshold})", zscore=z)

    def metrics(self) -> dict[str, float]:
        """Counters for the metrics sink and the status patch (names are stable)."""
        c = self.counters
        return {
            "guard_skipped_nonfinite": c.skipped_nonfinite,
            "guard_skipped_spike": c.skipped_spike,
            "guard_rollbacks": c.rollbacks,
            "guard_loss_zscore": c.last_zscore,
        }

    # Saved in trainer.json (JSON: plain lists and numbers) so the baseline, the recent spikes and the counters
    # survive a restart: a resumed run decides exactly as the uninterrupted one would have.
    def state_dict(self) -> dict[str, Any]:
        c = self.counters
        return {"history": list(self.history), "shares": list(self.shares), "spikes": list(self.spikes),
                "counters": {"skipped_nonfinite": c.skipped_nonfinite, "skipped_spike": c.skipped_spike,
                             "rollbacks": c.rollbacks},
                "skipped_data": [list(w) for w in self.skipped_data]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a smaller `window` than the saving run's keeps the newest losses (deque maxlen drops the oldest)
        history = [float(v) for v in state.get("history", [])]
        # none saved (before kiln weighed batch shares): every step then averaged the whole global batch
        shares = [float(v) for v in state.get("shares", [1.0] * len(history))]
        if len(shares) != len(history) or not all(0.0 < v < math.inf for v in shares):
            raise ValueError(f"guards: the saved state has {len(history)} losses but {len(shares)} batch shares, "
                             f"or a share that is not positive and finite")
        self.history = deque(history, maxlen=self.config.window)
        self.shares = deque(shares, maxlen=self.config.window)
        self.spikes = deque(int(s) for s in state.get("spikes", []))
        counters = state.get("counters", {})
        self.counters = GuardCounters(**{k: int(v) for k, v in counters.items()})
        self.skipped_data = [(int(a), int(b)) for a, b in state.get("skipped_data", [])][-MAX_SKIPPED_WINDOWS:]


def global_scalars(loss, grad_norm=None, group=None) -> tuple[float, float | None]:
    """Average the loss and the grad norm over `group`, so every rank feeds StepGuard the same numbers.

    For loops that do not already all-reduce them (kiln's loop does). A NaN/inf on any rank propagates
    into the sum, so all ranks skip together.
    """
    import torch
    import torch.distributed as dist

    values = torch.stack([torch.as_tensor(loss, dtype=torch.float64).detach().reshape(()).cpu(),
                          torch.as_tensor(0.0 if grad_norm is None else grad_norm,
                                          dtype=torch.float64).detach().reshape(()).cpu()])
    if dist.is_available() and dist.is_initialized():
        dev = _comm_device(group)
        values = values.to(dev)
        dist.all_reduce(values, group=group)
        values = values / dist.get_world_size(group)
    out = values.cpu().tolist()
    # The grad norm is already global after clip_grad_norm_ (equal on every rank), so the mean is itself.
    return out[0], (None if grad_norm is None else out[1])

def _comm_device(group):
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")
