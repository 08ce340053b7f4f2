"""The guards plugged into the training loop (kiln.trainer.hooks.StepHooks): step verdicts, SDC checks, GPU health."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable

from kiln.trainer.guards.sdc import SDC_INCIDENTS, SdcCheck, SilentDataCorruption
from kiln.trainer.guards.step import Action, Decision, GuardConfig, StepGuard

log = logging.getLogger("kiln.guards")



class GuardHooks:
    """StepGuard before the optimizer step, SdcCheck around it (the seal before, the replicas after) and the
    GPU health probe after it (at this process's first step, then at the end of the first step after each
    `health_interval_s` seconds on `clock`, so a run of slow steps does not space the probes out: local rank 0
    probes its node, rank 0 gathers every node's entry into the record as `gpu_health`; 0 turns probes off);
    counters go into the step's metrics record.

    A ROLLBACK decision sets `ctx.rollback = True`; the loop then restores the last commit and keeps its
    data cursor, so the offending data window is skipped. The StepGuard's own state is not rolled back: its
    counters count what happened, and its baseline holds only accepted losses.

    Registered as `hooks.state["guards"]`, the StepGuard's state goes into every checkpoint's trainer state
    and comes back on resume.
    """

    def __init__(self, config: GuardConfig | None = None, sdc_every: int = 100, health_interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.guard = StepGuard(config)
        self.sdc = SdcCheck(every=sdc_every)
        self.health_interval_s, self._clock = health_interval_s, clock
        self._gpus = None  # kiln.trainer.observe.gpu_health.GpuMonitor, opened on first use (on local rank 0)
        self._probed_at: float | None = None  # this process's clock at its last probe
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
        if self._health_due():
            from kiln.trainer.observe.gpu_health import GpuMonitor, expected_gpus, gather, node_name

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

    def _health_due(self) -> bool:
        """At this process's first step (a node that starts unhealthy is known, and left, at once), then once
        `health_interval_s` has passed. Every rank must probe at the same step (the gather is a collective), and
        the ranks' clocks and step ends differ: one 1-element all-reduce (MAX) per step makes it every rank's
        step when any rank's interval has passed; each restarts its interval there."""
        if self.health_interval_s <= 0:
            return False
        now = self._clock()
        due = _any_rank(self._probed_at is None or now - self._probed_at >= self.health_interval_s)
        if due:
            self._probed_at = now
        return due

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


def _any_rank(flag: bool) -> bool:
    """`flag` OR-ed over every rank of the job (this process's alone without a process group)."""
    import torch
    import torch.distributed as dist

    from kiln.trainer.guards.step import _comm_device

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=_comm_device(None))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _is_rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
