"""One training process's run: `setup()` builds it, `Run.step()` takes one optimizer step, `Run.close()` ends it
(the shape of TorchTitan's Trainer: a constructor that builds everything, a train step, a loop that calls it).

setup: join the process group -> model (meta, parallelize, allocate, initialise) -> optimizer -> data ->
checkpointer -> replica groups (torchft; then the metrics imports and a discarded warm-up step, before the join
that the live groups wait on) -> restore (a live peer's state, else the newest commit, else model.from or the
seed) -> metrics and status. One call per process (rank); torchrun or the training-operator
provides RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous. Every rank runs the same code; the mesh decides what
each one holds.

Where a run's events hook in (kiln.trainer.hooks.StepHooks), one place each: a resume from a commit in
`Run._restart`, a heal from a live peer in `Run._heal`, a torchft quorum change in kiln.trainer.membership.replica_groups (it calls
`StepHooks.membership_changed` itself: the run has nothing to update for it), the checkpoint store in
kiln.trainer.build.build_checkpointer; a guard's rollback in `Run._roll_back`.

Each part is built in kiln.trainer.build; the set-up's order (`Run.__init__`: it matters, e.g. replica groups warm
up before their join) and the step stay here, read in their order in one place (TorchTitan's train.py too): a
little over 400 lines for that reason.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from kiln.api import TrainingSpec
from kiln.trainer.build import (build_checkpointer, build_data, build_model_parts, init_distributed, run_preflight,
                                start_exporter)
from kiln.trainer.evaluate import validation_loss
from kiln.trainer.hooks import Heal, Restart, StepContext, StepHooks
from kiln.trainer.membership.strategy import open_membership
from kiln.trainer.model import hf_folder as hf, moe
from kiln.trainer.model.lora import check_base, init_adapters
from kiln.trainer.model.loss import global_count, global_loss
from kiln.trainer.observe import hang_report, tracking
from kiln.trainer.observe.gpu_health import node_name
from kiln.trainer.observe.metrics import MetricsLogger, StepTimer, flops_per_token, peak_flops, peak_memory_gib
from kiln.trainer.observe.startup import process_start_time
from kiln.trainer.observe.status_report import StatusReporter
from kiln.trainer.observe.stragglers import StragglerWatch
from kiln.trainer.optim import clip_grad_norm_, lr_at, set_lr
from kiln.trainer.parallel.microbatches import accumulate_step, pipeline_step
from kiln.trainer.rng import rng_state, set_rng_state
from kiln.trainer.state import Fixed, ModelState, Named, Progress, RngState, RunState


def setup(spec_doc: TrainingSpec, *, output_dir: Path | None, hooks: StepHooks | None = None,
          checkpoint_uri: str | None = None, checkpointing: bool = True,
          state_parts: dict[str, Stateful] | None = None) -> Run:
    """Build (or resume) the run described by `spec_doc`; metrics go to output_dir/metrics.jsonl on rank 0.

    hooks: None installs the training-health guards (kiln.trainer.guards), as do hooks with no step hooks.
    checkpointing=False neither restores nor saves (throughput benchmarks of models too big to save often).
    state_parts: more parts of the run's state (kiln.trainer.state), saved, restored, rolled back and healed
    with the rest (JSON state dicts, under their names in trainer.json).
    """
    hooks = hooks or StepHooks()
    if not hooks.before_update and not hooks.after_update:  # default: the training-health guards
        from kiln.trainer.guards.hooks import GuardHooks

        GuardHooks(health_interval_s=spec_doc.spec.resources.gpu_health_interval_seconds).install(hooks)
    # where a (re)start's seconds go, as epoch times: in the first record of each process (bench_faults)
    startup = {"process_start": process_start_time(), "imports_done": time.time()}
    rank, world, device = init_distributed()
    startup["rendezvous_done"] = time.time()
    try:
        return Run(spec_doc, output_dir=output_dir, hooks=hooks, checkpoint_uri=checkpoint_uri,
                   checkpointing=checkpointing, rank=rank, world=world, device=device, startup=startup,
                   state_parts=state_parts or {})
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


class Run:
    """Everything one process trains with, and where it is: `state` (kiln.trainer.state: every part a
    checkpoint, a rollback and a heal carry; `last_step` and `tokens_seen` are its progress), the loss of every
    step taken (`losses`). Built by `setup()`."""

    def __init__(self, spec_doc: TrainingSpec, *, output_dir: Path | None, hooks: StepHooks,
                 checkpoint_uri: str | None, checkpointing: bool, rank: int, world: int, device: torch.device,
                 startup: dict, state_parts: dict[str, Stateful]):
        self.spec_doc, self.spec = spec_doc, spec_doc.spec
        self.tr = self.spec.training
        self.hooks, self.rank, self.world, self.device = hooks, rank, world, device
        self.startup: dict | None = startup  # None once the first step has logged it
        self.progress = Progress()
        self.start_step = 0
        self.losses: list[float] = []
        self.stopped = False  # a stop was requested (SIGTERM) and saved
        self._closed = False
        self._finished = False  # finish() ran: a tracked run ends FINISHED, else FAILED
        self.watch = None  # the loop's hang watch, from the first step on
        self.tracking = None

        build_model_parts(self)
        build_data(self)
        build_checkpointer(self, checkpoint_uri, output_dir, checkpointing)
        run_preflight(self)  # before anything waits on this process: every rank's speed, the world's bandwidth
        # the run's state, one registry: a commit, a rollback and a heal carry these parts and nothing else
        self.reporter = StatusReporter.from_env(self.tr.steps, rank=rank)  # rank 0 → status; its time counters
        self.state = state = RunState(ModelState(self.model_parts, self.optimizers), self.progress)
        state.add("data", self.loader, rolls_back=False)  # a rollback skips the data that spiked
        state.add("rng", RngState(device))
        state.add("hooks", Named(hooks.state), rolls_back=False)  # the guards' baseline and counters
        state.add("goodput", self.reporter, rolls_back=False)  # counted from the run's start, across restarts
        if self.adapter is not None:  # LoRA: the base's identity, which a resume checks first (_check_commit)
            state.add("adapter", Fixed(self.adapter), rolls_back=False)
        for name, part in state_parts.items():
            state.add(name, part)
        # who takes part in a step: solo, or one replica group of several (kiln.trainer.membership.strategy)
        self.members = open_membership(self.spec, rank=rank, world=world, device=device, state=state,
                                       on_membership_change=self.hooks.membership_changed)
        exporter = start_exporter(spec_doc.metadata.name) if rank == 0 else None  # needs no restored state
        if self.members.waits_for_peers:  # from its join on, the live groups wait for this one: do before it what can be
            from kiln.trainer.observe.metrics import preload

            self._initial_weights()  # a peer's or a commit's replace them
            preload(output_dir, rank=rank)
            self.warm_up()
            self.startup["joining"] = time.time()
        self._restore()
        if self.preflight is not None:  # after the restore: the carried counters, then this start's check
            self.reporter.preflight(self.preflight, step=self.last_step)
        self.startup["restored"] = time.time()

        self.global_tokens = self.tr.global_batch_size * self.dims.seq_len
        self.flops_step = flops_per_token(self.dims) * self.global_tokens
        self.peak = peak_flops(device, self.tr.precision)  # None: no known peak, no MFU (kiln.trainer.observe.metrics)
        self.logger = MetricsLogger(output_dir, rank=rank, total_steps=self.tr.steps, start_step=self.start_step,
                                    exporter=exporter)
        self.tracking = tracking.start(spec_doc, store=getattr(self.checkpointer, "store", None),
                                       output_dir=output_dir) if rank == 0 else None
        self.timer = StepTimer(device)
        lag = self.spec.resources.stragglers
        self.stragglers = StragglerWatch(every=lag.every_steps, factor=lag.factor, window=lag.window,
                                         node=node_name(), device=device) if lag.enabled else None
        self.plan_steps = {p.until_step for p in self.spec.elastic.plan if p.until_step is not None}
        # From the first step on, a loop that stops moving is caught by its hang watch (the operator's rule): a
        # replica group takes itself out (kiln.trainer.membership.hang_watch); a solo run leaves every rank's stacks
        # in the store and names the rank the others wait for (kiln.trainer.observe.hang_report).
        self.watch = self.members.watch_hangs(self._hung)

    # ---- setup, in order --------------------------------------------------------------------------------------

    def _restore(self) -> None:
        """Where the state comes from: a live peer's (replica groups, when one is ahead), else the newest
        commit, else model.from (a new run) or the seed."""
        from_commit = False
        if self.members.join():  # a heal has loaded the whole state
            self._heal(at_start=True)
        else:
            lora = self.adapter is not None
            if lora and not self.members.waits_for_peers:  # a LoRA commit holds the adapters only: the base first
                self._initial_weights()
            state = self.checkpointer.restore(self.model_parts, self.optimizers, check=self._check_commit)
            from_commit = state is not None
            if from_commit:
                self._restart(state)
                if self.rank == 0:
                    print(self.checkpointer.resume_line(), flush=True)
            elif not self.members.waits_for_peers and not lora:  # a new run (replica groups: before their join)
                self._initial_weights()
        self.start_step = self.last_step
        self.reporter.resumed_at(self.last_step)
        self.members.restored(self.last_step, from_checkpoint=from_commit)

    def _initial_weights(self) -> None:
        """A new run's weights: model.from's, else initialised from training.seed. A resumed run skips it (the
        commit holds every weight), except a replica group, which sets them before its join (nobody waits
        for it yet) and then takes a live peer's or the newest commit's, if there are any."""
        if self.spec.model.from_:
            hf.load_weights(self.model, self.spec.model.from_, self.dims, endpoint=hf.storage_endpoint(self.spec))
        else:
            self.model.init_weights(self.tr.seed)
        if self.adapter is not None:  # LoRA: B = 0, so the run starts as its base
            init_adapters(self.model, self.tr.seed)

    def _check_commit(self, state: dict, where: str) -> str | None:
        """Why a commit is not this run's to resume (LoRA adapters on another base), else None."""
        return check_base(state.get("adapter"), self.adapter, where)

    def warm_up(self) -> None:
        """One forward/backward and gradient clip on a dummy batch of the step's shapes, then discarded: the
        first call's overheads (allocations, kernel selection, autograd set-up, compile when on) are paid here,
        not in the first real step, which live replica groups wait for in their allreduce. It changes no state:
        the gradients are dropped, the optimizer is not stepped, the data cursor is not read and the RNG
        stream is put back (every rank of the group runs it, so the group's own collectives match)."""
        rows = self.members.rows_per_step // self.dp_size
        dummy = torch.zeros((rows, self.dims.seq_len), dtype=torch.long, device=self.device)
        rng = rng_state(self.device)
        self._forward_backward(dummy, dummy, None, torch.zeros_like(dummy) if self.loader.packed else None)
        clip_grad_norm_(self.params, self.tr.grad_clip, pp_group=self.pp_group)
        self.optimizer.zero_grad(set_to_none=True)
        set_rng_state(rng, self.device)
        self.startup["warmed_up"] = time.time()

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, denominator: torch.Tensor | None,
                          doc_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.schedule is not None:
            self.pp_loss.denominator = denominator
            return pipeline_step(self.schedule, inputs, targets, self.is_first, self.is_last, doc_ids=doc_ids)
        return accumulate_step(self.model, inputs, targets, self.layout, denominator, doc_ids)

    # ---- the events hooks see, one place each -----------------------------------------------------------------

    def _restart(self, state: dict) -> None:
        """Resumed from a commit (not a guard's rollback, which keeps the data cursor: see step)."""
        self.state.load_trainer_state(state)
        self.hooks.restarted(Restart(self.last_step, self.tokens_seen))

    def _heal(self, *, at_start: bool) -> None:
        """Took a live peer's state (all of it loaded already, by kiln.trainer.membership.replica_groups)."""
        self.hooks.healed(Heal(self.last_step, self.tokens_seen, at_start=at_start))

    def _roll_back(self, step: int) -> int:
        """A guard asked for it (repeated loss spikes): back to the newest commit; the step it holds, or `step`
        when there is none. The loader keeps its cursor, so the offending data is skipped; hook state (the
        guards' counters and baseline) is not rolled back.

        Replica groups roll back together, each from the store, alone or not. Every group of the quorum decides
        it at the same step: the guards see the same job-wide loss, batch share and guard state (a joining
        group receives it with its heal). No peer holds better weights to heal from (all hold the ones that
        spiked), and a group left at the spiked step would be the most advanced at the next quorum: torchft
        would heal the others from it, undoing the rollback. A group that finds an older commit than another
        (the writer's last save still uploading) is behind at the next quorum and heals from the newest one."""
        with self._waiting():
            state = self.checkpointer.restore(self.model_parts, self.optimizers)
        if state is None:
            return step
        self.state.load_trainer_state(state, rollback=True)
        return self.last_step

    # ---- where the run is: the registry's progress --------------------------------------------------------------

    @property
    def last_step(self) -> int:
        return self.progress.step

    @last_step.setter
    def last_step(self, step: int) -> None:
        self.progress.step = step

    @property
    def tokens_seen(self) -> int:
        return self.progress.tokens_seen

    @tokens_seen.setter
    def tokens_seen(self, tokens: int) -> None:
        self.progress.tokens_seen = tokens

    # ---- the step ---------------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.stopped or self.last_step >= self.tr.steps

    def step(self) -> None:
        """One optimizer step: data, forward/backward, (replica groups: average, vote), clip, hooks, optimizer,
        metrics and status, a checkpoint when due. Replica groups: a step the groups did not commit is not
        taken (`last_step` stays; the next call redoes it), and a group that fell behind heals first."""
        tr, members, layout, device, timer = self.tr, self.members, self.layout, self.device, self.timer
        if members.begin_step(self.last_step):  # fell behind: took a peer's state
            self._heal(at_start=False)
            if self.done:
                return
        step = self.last_step + 1
        timer.start()
        if self.stragglers is not None:
            self.stragglers.begin()
        batch = members.next_batch(self.loader, self.dp_rank, self.dp_size)
        inputs, targets, *doc_ids = (t.to(device) for t in batch)  # doc_ids: packed rows (data.packing)
        timer.mark("data_s")
        lr = lr_at(step, tr)
        set_lr(self.optimizer, lr)
        # chat data, packed rows: the mean over the global batch's loss-carrying tokens (kiln.trainer.model.loss)
        denominator = global_count(targets, layout) if self.loader.masked else None
        local_loss = self._forward_backward(inputs, targets, denominator, *doc_ids)
        timer.mark("fwd_bwd_s")
        members.reduce_gradients(self.model_parts)  # before clipping: every replica group clips alike
        grad_norm = clip_grad_norm_(self.params, tr.grad_clip, pp_group=self.pp_group, optimizer=self.optimizer)
        loss = members.reduce_loss(global_loss(local_loss if self.reports_loss else None, layout, device))
        if not members.commit(self.loader):  # a group failed mid-step: nobody steps, redo it with the next quorum
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.last_step = step
        self.tokens_seen += members.step_tokens(self.dims.seq_len)
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm)}
        if denominator is not None:  # the tokens the loss was taken on (tokens_seen counts all, padding too)
            record["assistant_tokens" if self.spec.data.format == "chat" else "loss_tokens"] = int(denominator)
        record.update(members.metrics())
        record.update(self._router_metrics())
        ctx = StepContext(step, loss, float(grad_norm), self.model_parts, self.optimizers, self.mesh, record,
                          batch_share=members.batch_share)
        if all(hook(ctx) for hook in self.hooks.before_update):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for hook in self.hooks.after_update:
            hook(ctx)
        if ctx.rollback:
            step = record["rolled_back_to"] = self._roll_back(step)
        timer.mark("optim_s")
        self.losses.append(loss)
        if step == tr.steps:
            record.update(members.final_metrics())
        if self.stragglers is not None:  # every N steps one all-gather of each rank's own and waiting time
            self.stragglers.end(step, record)
        self._finish_step(step, record)

    def _router_metrics(self) -> dict:
        """A mixture of experts' router over this step's microbatches (kiln.trainer.model.moe.RouterLoad), summed
        over this rank's model parts, over the data-parallel ranks (one all-reduce: the whole global batch's
        loads) and over the pipeline stages (another: each routed the batch through its own layers); {} for a
        dense model."""
        if self.dims.moe is None:
            return {}
        merged = moe.RouterLoad.merged([part.router_load for part in self.model_parts])
        if self.layout.dp > 1:
            merged.sum_over(self.mesh["dp"].get_group(), self.device)
        if self.layout.pp > 1:
            merged.sum_over(self.pp_group, self.device)
        return merged.read() or {}

    def _finish_step(self, step: int, record: dict) -> None:
        """The step's record, status and checkpoint (when due), and the held-out loss after the last step."""
        tr, timer = self.tr, self.timer
        step_s = sum(timer.times.values())
        record.update(timer.times, step_s=step_s, tokens_per_second=self.global_tokens / step_s,
                      mfu=self.flops_step / step_s / (self.peak * self.world) if self.peak else None,
                      world_size=self.world, global_batch_tokens=self.global_tokens,
                      tokens_seen=self.tokens_seen, peak_memory_gib=peak_memory_gib(self.device),
                      **self.layout.as_dict())
        if (mix := self.loader.mix()) is not None:
            record["data_mix"] = mix
        if self.startup is not None:  # the first step of this process (compile, if any, happens in it)
            record["startup"], self.startup = {**self.startup, "first_step_done": time.time()}, None
            if self.preflight is not None:
                record["preflight"] = self.preflight
        checkpointer = self.checkpointer
        ckpt = checkpointer.status()  # before the save: it carries the time counters
        if "intervalSteps" in ckpt:  # checkpoint freshness in steps, for alerts that follow progress
            record["checkpoint_interval_steps"] = ckpt["intervalSteps"]
            record["steps_since_commit"] = step - (ckpt.get("lastCheckpoint") or {}).get("step", self.start_step)
        if self.tracking is not None:  # the trackers' drops and failures, for status.tracking and the log
            self.tracking.annotate(record)
        self.reporter.update(record, ckpt)
        stop = checkpointer.stop_requested(step)
        final = step == tr.steps or stop
        # elastic.plan switches the node count once its untilStep is committed: always commit it
        # replica groups: one writer, the group at replica rank 0 of this step's quorum
        # a rollback's step is the commit just restored: not written again (other groups may be reading it)
        restored = record.get("rolled_back_to", record["step"]) != record["step"]
        if (final or step in self.plan_steps or checkpointer.should_save(step)) and not restored \
                and self.members.writes_checkpoints:
            with self._waiting():
                checkpointer.save(step, self.model_parts, self.optimizers, self.state.trainer_state(), final=final)
            record["checkpoint_stall_s"] = checkpointer.stats.last_blocking_s + checkpointer.stats.last_wait_s
            self.reporter.stalled(record["checkpoint_stall_s"])
        if step == tr.steps and self.val_loader is not None:
            with self._waiting():
                record["val_loss"] = validation_loss(self.model, self.schedule, self.val_loader, tr.global_batch_size,
                                                     self.layout, self.device, is_first=self.is_first,
                                                     is_last=self.is_last, reports_loss=self.reports_loss)
        if self.tracking is not None:
            self.tracking.commit(ckpt.get("lastCheckpoint"))
        if step % tr.log_every == 0 or final:
            if self.tracking is not None:
                self.tracking.offer(record)  # never waits
            self.logger.log(record)
        elif "gpu_health" in record or "stragglers" in record:  # gauges follow every reading, logged or not
            self.logger.export(record)
        if stop:
            self.stopped = True
            if self.rank == 0:
                print(f"kiln: stop requested; saved step {step}, rerun to resume", flush=True)
        if self.watch is not None:
            self.watch.stepped()

    def _waiting(self):
        """A long phase of the run's own (a save, a commit read, the evaluation): paused in its hang watch."""
        return self.watch.waiting() if self.watch is not None else nullcontext()

    def _hung(self, why: str) -> None:
        """The hang watch's verdict (its thread; the main thread is stuck): this rank's stacks to the store, and
        on rank 0 the rank the others wait for, in one line and status.hang. The operator restarts the run."""
        store = getattr(self.checkpointer, "store", None)
        if store is None:
            print(f"kiln: hang: {why.partition('; ')[0]} (no checkpoint store for the stacks)", file=sys.stderr,
                  flush=True)
            return
        group = getattr(self.members, "group", None)  # a replica group leaves alone: its own stacks only
        try:
            if group is not None:
                hang_report.write_own(store, rank=self.rank, step=self.last_step, why=why,
                                      device_type=self.device.type, group=group)
            else:
                hang_report.report(store, rank=self.rank, world=self.world, step=self.last_step, why=why,
                                   status=self.reporter, device_type=self.device.type)
        except Exception as err:  # a diagnosis must never be what fails the run
            print(f"kiln: hang: could not write the stacks: {err}", file=sys.stderr, flush=True)

    # ---- the end ----------------------------------------------------------------------------------------------

    def finish(self) -> None:
        """After the last step: wait for the last save, close, and leave together. Every rank leaves after rank
        0's last commit, status report and log lines: on a cluster, the first worker pod to exit 0 ends the
        elastic job, and a pod still running then may be stopped."""
        if self.watch is not None:  # no more steps: the last upload and the barrier are not the loop's
            self.watch.stop()
        self.checkpointer.wait()
        if self.tracking is not None:
            self.tracking.commit(self.checkpointer.status().get("lastCheckpoint"))
        self._finished = True
        self._close_parts()
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        """Close whatever finish() did not (after an error), and leave the process group."""
        try:
            self._close_parts()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def _close_parts(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.watch is not None:
            self.watch.stop()
        try:
            self.checkpointer.close()
            self.reporter.close(self.checkpointer.status())
            self.logger.close()
            if self.tracking is not None:
                self.tracking.close(ok=self._finished)
        finally:
            self.members.close()



