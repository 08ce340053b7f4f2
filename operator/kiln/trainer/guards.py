"""Training-health guards: never take an optimizer step on garbage, never commit corrupted weights.

Two hooks the training loop calls, in this order, after backward and gradient clipping:

    decision = step_guard.check(step, loss, grad_norm)      # pure: same inputs → same decision on every rank
    if decision.action is Action.SKIP:     optimizer.zero_grad(); continue
    if decision.action is Action.ROLLBACK: reload the last COMMITTED checkpoint, skip decision.skip_data
    optimizer.step()
    if sdc.due(step): sdc.verify(model, step, loss=global_loss)   # raises before the step can be committed

`StepGuard` is pure Python (no torch): give it the *global* loss and grad norm (`global_scalars`
all-reduces them, so a NaN on any rank becomes a NaN on every rank and all ranks decide alike).
`SdcCheck` hashes the bits of every parameter on device and makes two comparisons:
- replicas (`verify`): between the ranks that must hold identical copies: for DTensor parameters
  (FSDP2/HSDP, TP) the ranks along the mesh dimensions whose placement is `Replicate()`; for plain tensors
  (DDP) every rank of the given group. Plain FSDP has no such copy.
- the seal (`seal` after one step's update, `verify_seal` before the next one's): every rank's own shards
  and optimizer state against their fingerprint from the previous update, which every rank of the job
  holds. Nothing may change them in between (forward and backward only read them), so this checks every
  layout, plain FSDP included, and names the exact rank.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import statistics
import time
import uuid
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
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


# ---------------------------------------------------------------------------------------------------
# Silent data corruption


# Under the run's checkpoint URI: one JSON object (step, suspect ranks, detail, time) per SDC mismatch the run
# met; kept across restarts and never pruned with the checkpoints.
SDC_INCIDENTS = "incidents/sdc/"


class SilentDataCorruption(RuntimeError):
    """Replicas that must hold bit-identical weights (or agree on a loss) do not; the step must not commit."""

    def __init__(self, step: int, ranks: list[int], detail: str) -> None:
        self.step, self.ranks, self.detail = step, sorted(ranks), detail
        super().__init__(f"silent data corruption at step {step}: suspect rank(s) {self.ranks}: {detail}")


_INT_VIEW = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
_PRIME = 65521  # position weights 1..65521 make a flip's effect depend on where it happened


def tensor_fingerprint(t):
    """Two int64 checksums of the raw bits of `t` (computed on its device; wrap-around is deterministic)."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    bits = flat.view(getattr(torch, _INT_VIEW[flat.element_size()])).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % _PRIME + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def _comm_device(group):
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")


def _suspects(rows: list[tuple], group_ranks: list[int]) -> list[int]:
    """Ranks whose fingerprint differs from the majority; every rank when there is no strict majority."""
    counts: dict[tuple, int] = {}
    for r in rows:
        counts[r] = counts.get(r, 0) + 1
    best, n = max(counts.items(), key=lambda kv: kv[1])
    if n * 2 <= len(rows):  # 1-vs-1 (or a tie): cannot tell who is wrong, name all of them
        return list(group_ranks)
    return [rank for rank, row in zip(group_ranks, rows) if row != best]


@dataclass
class SdcCheck:
    """Every `every` steps: compare the weights with their replicas and with their seal; raise naming the
    rank(s). The seal is taken after the update of the step before a due step and verified before the due
    step's update, so each check covers one step's forward and backward."""

    every: int = 100
    group: Any = None  # for plain-tensor (DDP/replicated) params: the ranks that hold identical copies
    checks: int = field(default=0, init=False)  # due steps at which weights were compared with something
    mismatches: int = field(default=0, init=False)
    _sealed: tuple | None = field(default=None, init=False)  # (step, [ranks, 2] digests, {name: fingerprint})
    _counted: int | None = field(default=None, init=False)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def seal_due(self, step: int) -> bool:
        return self.due(step + 1)

    def _count(self, step: int) -> None:
        if self._counted != step:
            self._counted = step
            self.checks += 1

    def seal(self, model_parts, step: int, optimizers=()) -> None:
        """After `step`'s update: fingerprint this rank's parameters and optimizer state; every rank keeps
        every rank's digest (collective over the job)."""
        fps = _state_fingerprints(model_parts, optimizers)
        self._sealed = (step, _all_digests(fps), fps)

    def verify_seal(self, model_parts, step: int, optimizers=()) -> bool:
        """Before `step`'s update: raise SilentDataCorruption on every rank if any rank's parameters or
        optimizer state changed since the seal of step - 1. False when there is no such seal (the first
        check after a start or a rollback): nothing was compared. Collective over the job."""
        import torch
        import torch.distributed as dist

        sealed, self._sealed = self._sealed, None
        if sealed is None or sealed[0] != step - 1:
            return False
        _, then, mine_then = sealed
        fps = _state_fingerprints(model_parts, optimizers)
        now = _all_digests(fps)
        self._count(step)
        # Every rank compares every rank's digest with its own copy of the seal: the verdict does not rest
        # on the corrupted rank's view of itself, and it is the same on every rank.
        changed = (now != then).any(dim=1).nonzero().flatten().tolist()
        if not changed:
            return True
        self.mismatches += 1
        names = [n for n, fp in fps.items() if not torch.equal(fp, mine_then.get(n, fp))]
        detail = f"{', '.join(names[:5])}{' …' if len(names) > 5 else ''}" if names else ""
        details = [detail]
        if dist.is_available() and dist.is_initialized():
            details = [None] * dist.get_world_size()
            dist.all_gather_object(details, detail)
        where = "; ".join(f"rank {r}: {details[r]}" for r in changed if details[r])
        raise SilentDataCorruption(step, changed, f"weights changed between the update of step {step - 1} and "
                                   f"step {step}'s update, with no update in between" + (f" ({where})" if where else ""))

    def verify(self, model, step: int, loss=None, loss_group=None) -> None:
        """Collective over the replica groups of `model`'s parameters (and `loss_group` for the loss).

        Every rank of the job must call it at the same step. Raises SilentDataCorruption on *every* rank
        when any replica group disagrees, before the caller commits anything. Parameters without a
        replicated mesh dimension (plain FSDP over one shard dim) have no second copy here; `seal` and
        `verify_seal` check those.
        """
        import torch
        import torch.distributed as dist

        # (group key) → (process group, [param names], [fingerprints]); DTensor params per replicated mesh dim.
        buckets: dict[tuple, tuple[Any, list[str], list]] = {}
        for name, p in model.named_parameters():
            local, dims = _local_and_replica_groups(p, self.group)
            if not dims:
                continue
            fp = tensor_fingerprint(local)
            for key, pg in dims:
                buckets.setdefault(key, (pg, [], []))
                buckets[key][1].append(name)
                buckets[key][2].append(fp)
        if buckets:
            self._count(step)

        problems: list[tuple[list[int], str]] = []
        for key in sorted(buckets, key=repr):
            pg, names, fps = buckets[key]
            mine = torch.stack(fps)
            dev = _comm_device(pg)
            gathered = [torch.empty_like(mine, device=dev) for _ in range(dist.get_world_size(pg))]
            dist.all_gather(gathered, mine.to(dev), group=pg)
            ranks = dist.get_process_group_ranks(pg)
            table = torch.stack(gathered).cpu()  # [ranks, params, 2]
            bad = (table != table[0]).any(dim=2).any(dim=0).nonzero().flatten().tolist()
            if bad:
                suspects: set[int] = set()
                for i in bad:
                    suspects.update(_suspects([tuple(row[i].tolist()) for row in table], ranks))
                problems.append((sorted(suspects), f"weights differ across replicas {ranks} in "
                                 f"{', '.join(names[i] for i in bad[:5])}{' …' if len(bad) > 5 else ''}"))

        if loss is not None:
            lg = loss_group
            mine = torch.as_tensor(loss, dtype=torch.float64).detach().reshape(1).cpu()
            dev = _comm_device(lg)
            gathered = [torch.empty(1, dtype=torch.float64, device=dev) for _ in range(dist.get_world_size(lg))]
            dist.all_gather(gathered, mine.to(dev), group=lg)
            values = [g.item() for g in gathered]
            ranks = dist.get_process_group_ranks(lg) if lg is not None else list(range(dist.get_world_size()))
            if len({torch.tensor(v, dtype=torch.float64).view(torch.int64).item() for v in values}) > 1:
                problems.append((_suspects([(v,) for v in values], ranks),
                                 f"same-step loss differs across ranks {ranks}: {values}"))

        # Agree on the verdict job-wide, so no rank goes on to commit while another group found corruption.
        world = dist.get_world_size()
        flags = torch.zeros(world + 1, dtype=torch.int32)
        for rs, _ in problems:
            flags[rs] = 1
        flags[world] = int(bool(problems))
        flags = flags.to(_comm_device(None))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        flags = flags.cpu()
        if flags[world]:
            self.mismatches += 1
            details: list = [None] * world
            dist.all_gather_object(details, "; ".join(d for _, d in problems))
            ranks = flags[:world].nonzero().flatten().tolist()
            raise SilentDataCorruption(step, ranks, "; ".join(sorted({d for d in details if d})))

    def describe(self, model_parts) -> str:
        """What a check compares in this layout, for the start of a run."""
        if self.every <= 0:
            return "sdc: off (no weights are compared)"
        import torch.distributed as dist

        dims: set[str] = set()
        for part in model_parts:
            for _, p in part.named_parameters():
                dims.update(key[0] for key, _ in _local_and_replica_groups(p, self.group)[1])
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        replicas = (f"copies compared across {', '.join(sorted(d.replace('plain', 'data parallel') for d in dims))}"
                    if dims else "no replicated copies to compare in this layout")
        return (f"sdc: every {self.every} steps: each rank's weights and optimizer state against their seal "
                f"from the previous step's update (held by all {world} rank(s)); {replicas}")

    def metrics(self) -> dict[str, float]:
        return {"sdc_checks": self.checks, "sdc_mismatches": self.mismatches}


def _state_fingerprints(model_parts, optimizers=()) -> dict:
    """{name: fingerprint} of this rank's local parameters and their optimizer state tensors."""
    import torch
    from torch.distributed.tensor import DTensor

    local = (lambda t: t.to_local() if isinstance(t, DTensor) else t)  # noqa: E731
    fps, names = {}, {}
    for i, part in enumerate(model_parts):
        prefix = f"{i}." if len(model_parts) > 1 else ""
        for name, p in part.named_parameters():
            names[id(p)] = prefix + name
            fps[prefix + name] = tensor_fingerprint(local(p))
    for opt in optimizers:
        for p, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    fps[f"{names.get(id(p), '?')}:{key}"] = tensor_fingerprint(local(value))
    return fps


def _all_digests(fps: dict):
    """Every rank's digest of its fingerprints, [world, 2] int64 on CPU (a collective over the job)."""
    import torch
    import torch.distributed as dist

    dev = _comm_device(None) if dist.is_available() and dist.is_initialized() else torch.device("cpu")
    if fps:
        table = torch.stack([fp.to(dev) for fp in fps.values()])  # [n, 2]; optimizer steps may be on CPU
        weights = torch.arange(1, table.shape[0] + 1, device=table.device, dtype=torch.int64)
        mine = (table * weights[:, None]).sum(dim=0)  # order-sensitive: a change moves the sums
    else:
        mine = torch.zeros(2, dtype=torch.int64)
    if not (dist.is_available() and dist.is_initialized()):
        return mine.cpu()[None]
    gathered = [torch.empty(2, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine.to(dev))
    return torch.stack(gathered).cpu()


def _local_and_replica_groups(p, default_group):
    """The local bits of `p` and the (key, process group) pairs along which they must be identical."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(p, DTensor):
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
        groups = []
        for dim, placement in enumerate(p.placements):
            if isinstance(placement, Replicate) and mesh.size(dim) > 1:
                pg = mesh.get_group(dim)
                groups.append(((names[dim], tuple(dist.get_process_group_ranks(pg))), pg))
        return p.to_local(), groups
    pg = default_group if default_group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(pg))
    # A plain parameter at one data-parallel rank (no FSDP wrapper, parallel.uses_fsdp) has no second copy.
    return p, [(("plain", ranks), pg)] if len(ranks) > 1 else []


# ---------------------------------------------------------------------------------------------------
# The trainer's hooks (kiln.trainer.hooks.StepHooks): duck-typed on its StepContext.


class GuardHooks:
    """StepGuard before the optimizer step, SdcCheck around it (the seal before, the replicas after) and the
    GPU health probe after it (at this process's first step and every `health_every` steps: local rank 0
    probes its node, rank 0 gathers every node's entry into the record as `gpu_health`); counters go into
    the step's metrics record.

    A ROLLBACK decision sets `ctx.rollback = True`; the loop then restores the last commit and keeps its
    data cursor, so the offending data window is skipped. The StepGuard's own state is not rolled back: its
    counters count what happened, and its baseline holds only accepted losses.

    Registered as `hooks.state["guards"]`, the StepGuard's state goes into every checkpoint's trainer state
    and comes back on resume.
    """

    def __init__(self, config: GuardConfig | None = None, sdc_every: int = 100, health_every: int = 100) -> None:
        self.guard = StepGuard(config)
        self.sdc = SdcCheck(every=sdc_every)
        self.health_every = health_every
        self._gpus = None  # kiln.trainer.health.GpuMonitor, opened on first use (on local rank 0)
        self._probed = False
        self._described = False  # the SDC check says once, at the first step, what it compares
        self._incidents = None  # the checkpoint store the run's SDC mismatches are recorded in (record_incidents)
        self.last: Decision | None = None

    def before_update(self, ctx) -> bool:
        if not self._described:
            self._described = True
            if self.sdc.group is None and ctx.mesh is not None:  # plain-tensor params replicate over this
                self.sdc.group = ctx.mesh["dp_replicate"].get_group()
            if _is_rank_zero():
                print(f"kiln: {self.sdc.describe(ctx.model_parts)}", flush=True)
        if self.sdc.due(ctx.step):  # raises SilentDataCorruption (every rank) if any rank's state changed
            with self._incident_recorded():
                self.sdc.verify_seal(ctx.model_parts, ctx.step, ctx.optimizers)
        d = self.guard.check(ctx.step, ctx.loss, ctx.grad_norm, share=ctx.batch_share)
        self.last = d
        ctx.record.update(self.guard.metrics(), guard_action=d.action.value)
        if d.reason:
            ctx.record["guard_reason"] = d.reason
        if d.action is Action.ROLLBACK:
            ctx.rollback = True
        return d.action is Action.OK

    def after_update(self, ctx) -> None:
        if self.sdc.due(ctx.step):
            with self._incident_recorded():
                for part in ctx.model_parts:  # raises SilentDataCorruption (every rank) before anything is saved
                    self.sdc.verify(part, ctx.step, loss=ctx.loss)
        ctx.record.update(self.sdc.metrics())  # every step: the counts so far (the run's mismatches included)
        if self.sdc.seal_due(ctx.step) and not ctx.rollback:  # a rollback reloads the weights: nothing to seal
            self.sdc.seal(ctx.model_parts, ctx.step, ctx.optimizers)
        if self.health_every > 0 and (not self._probed or ctx.step % self.health_every == 0):
            # at this process's first step too: a node that starts unhealthy is known (and left) at once
            self._probed = True
            from kiln.trainer.health import GpuMonitor, expected_gpus, gather, node_name

            report = None
            if _local_rank() == 0:  # one prober per node; every rank takes part in the gather
                if self._gpus is None:
                    self._gpus = GpuMonitor()
                report = self._gpus.probe(expected_gpus())
            entries = gather(report.entry(node_name(), ctx.step) if report is not None else None)
            if report is not None:
                ctx.record.update(report.metrics())
            if _is_rank_zero():
                ctx.record["gpu_health"] = entries  # status.gpuHealth and kiln_gpu_health, every node

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """`None`: the checkpoint predates saved guard state; resume anyway with a fresh detector."""
        if state is not None:
            self.guard.load_state_dict(state)
            return
        if _is_rank_zero():
            log.warning("guards: the checkpoint carries no guard state (saved by an older kiln); the loss-spike "
                        "detector warms up again (no spike verdict before %d accepted losses) and the skip and "
                        "rollback counters restart at 0", self.guard.config.min_history)

    def record_incidents(self, store) -> None:
        """Keep this run's SDC mismatches in `store` (its checkpoint store; rank 0 reads and writes), one object
        under SDC_INCIDENTS each. A mismatch ends the process, so its count would die with it: counted from
        the store, `sdc_mismatches` (kiln_train_sdc_mismatches) is the run's, across the restarts."""
        self._incidents = store
        if _is_rank_zero():
            self.sdc.mismatches = len(store.list(SDC_INCIDENTS))

    @contextmanager
    def _incident_recorded(self):
        try:
            yield
        except SilentDataCorruption as err:
            if self._incidents is not None and _is_rank_zero():
                body = {"step": err.step, "ranks": err.ranks, "detail": err.detail, "time": time.time()}
                try:  # the verdict goes on whatever happens here
                    self._incidents.put_bytes(f"{SDC_INCIDENTS}step-{err.step:08d}-{uuid.uuid4().hex[:8]}.json",
                                              json.dumps(body).encode())
                except Exception as store_err:  # noqa: BLE001 - reported, never masks the corruption
                    log.warning("sdc: could not record the mismatch in the checkpoint store: %s", store_err)
            raise

    def install(self, hooks) -> None:
        hooks.before_update.append(self.before_update)
        hooks.after_update.append(self.after_update)
        hooks.incident_stores.append(self.record_incidents)
        hooks.state["guards"] = self


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _is_rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
