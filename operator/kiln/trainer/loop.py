"""The training function: mesh -> model -> parallelize -> optimizer -> restore -> steps -> log -> checkpoint.

One call per process (rank); torchrun or the training-operator provides RANK, WORLD_SIZE, LOCAL_RANK and
the rendezvous. Every rank runs the same code; the mesh decides what each one holds.

Guards and other per-step logic hook in through `StepHooks` (see below) instead of editing this loop.
"""

from __future__ import annotations

import base64
import io
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kiln.api import TrainingSpec, contract
from kiln.api.layout import replica_group_spec
from kiln.trainer import hf, kernels
from kiln.trainer.data import GlobalBatchLoader, open_data, open_source
from kiln.trainer.metrics import (MetricsLogger, StepTimer, flops_per_token, mfu_note, peak_flops, process_start_time,
                                  peak_memory_gib)
from kiln.trainer.loss import PipelineLoss, global_count, microbatch_loss
from kiln.trainer.model import build_model, cross_entropy
from kiln.trainer.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from kiln.trainer.parallel import Layout, build_mesh, build_pipeline_schedule, dp_coordinates, parallelize, plan_layout
from kiln.trainer.status_report import StatusReporter


@dataclass
class StepContext:
    """What a hook sees after backward and clipping, before the optimizer step."""

    step: int
    loss: float  # global mean loss of this step (identical on every rank)
    grad_norm: float  # global gradient norm before clipping (identical on every rank)
    model_parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    mesh: object
    record: dict  # the metrics record of this step; hooks may add fields
    rollback: bool = False  # a hook sets it: restore the last commit, keep the data cursor (kiln.trainer.guards)


@dataclass
class StepHooks:
    """Where guards plug in. `before_update` hooks return False to skip this optimizer step (the gradients
    are dropped, the data is still consumed); `after_update` hooks run after the step (e.g. SDC checks).

    `state` names objects whose `state_dict()` (JSON-serialisable) goes into every checkpoint's trainer state
    under "hooks"/<name>; on resume each gets `load_state_dict(saved)`, or `load_state_dict(None)` when the
    checkpoint has nothing under its name (saved before the hook kept state)."""

    before_update: list[Callable[[StepContext], bool]] = field(default_factory=list)
    after_update: list[Callable[[StepContext], None]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainResult:
    start_step: int  # the step restored from a checkpoint (0 for a fresh run)
    final_step: int
    losses: list[float]  # global loss of every step this call ran


def _encode_tensor(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _decode_tensor(s: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(s)), weights_only=True)


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": _encode_tensor(torch.get_rng_state())}
    if device.type == "cuda":
        state["cuda"] = _encode_tensor(torch.cuda.get_rng_state(device))
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(_decode_tensor(state["cpu"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_decode_tensor(state["cuda"]), device)


def _init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun set up (or a world of one without torchrun)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a plain `kiln train` without torchrun
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
        dist.init_process_group(backend, rank=rank, world_size=world,
                                device_id=device if device.type == "cuda" else None)
    return rank, world, device


def train(spec_doc: TrainingSpec, *, output_dir: Path | None, hooks: StepHooks | None = None,
          checkpoint_uri: str | None = None, checkpointing: bool = True) -> TrainResult:
    """Train (or resume) the run described by `spec_doc`; metrics go to output_dir/metrics.jsonl on rank 0.

    checkpointing=False neither restores nor saves (throughput benchmarks of models too big to save often).
    """
    spec = spec_doc.spec
    tr, par = spec.training, spec.parallelism
    hooks = hooks or StepHooks()
    if not hooks.before_update and not hooks.after_update:  # default: the training-health guards
        from kiln.trainer.guards import GuardHooks

        GuardHooks().install(hooks)
    # where a (re)start's seconds go, as epoch times: in the first record of each process (bench_faults)
    startup = {"process_start": process_start_time(), "imports_done": time.time()}
    rank, world, device = _init_distributed()
    startup["rendezvous_done"] = time.time()
    try:
        dims = hf.resolve_dims(spec)  # a model folder's config.json (model.from), else the preset and fields
        tokenizer = hf.training_tokenizer(spec, dims)
        # elastic.faultTolerance replicaGroups: this job is one replica group, with its share of the batch
        layout = plan_layout(replica_group_spec(spec), dims, world, int(os.environ.get("LOCAL_WORLD_SIZE") or world))
        kernels.set_mode(par.kernels)
        torch.manual_seed(tr.seed)

        # Model: shapes on meta, parallelize, then allocate on the device and initialise by parameter name.
        mesh = build_mesh(layout, device.type)
        model = parallelize(build_model(dims), mesh, layout, spec)
        model.to_empty(device=device)
        model.init_buffers()  # the weights: from model.from, a peer, this run's commit, or init_weights (below)
        if ft_enabled(spec) and not spec.model.from_:  # a group with no peer and no commit starts from the seed
            model.init_weights(tr.seed)
        model.train()
        if rank == 0:  # what runs, and what the numbers are measured against, once per run
            print(f"kiln: {kernels.describe(device, tensor_parallel=layout.tp, dim=dims.dim, compiled=par.compile)}",
                  flush=True)
            print(f"kiln: {mfu_note(device, tr.precision)}", flush=True)
        model_parts = [model]
        optimizer = build_optimizer(model_parts, tr, device)
        optimizers = [optimizer]
        startup["model_built"] = time.time()

        pp_rank = mesh["pp"].get_local_rank()
        is_first, is_last = pp_rank == 0, pp_rank == layout.pp - 1
        pp_loss = PipelineLoss(cross_entropy, layout)
        schedule = build_pipeline_schedule(model, mesh, layout, device, pp_loss) if layout.pp > 1 else None
        pp_group = mesh["pp"].get_group() if layout.pp > 1 else None
        # Exactly one rank per data-parallel replica reports the loss: the last stage, tensor rank 0.
        reports_loss = is_last and mesh["tp"].get_local_rank() == 0

        dp_rank, dp_size = dp_coordinates(mesh)
        source = open_data(spec.data, seq_len=dims.seq_len, vocab_size=dims.vocab_size, seed=tr.seed,
                           endpoint=os.environ.get("KILN_DATA_ENDPOINT") or spec.checkpoint.endpoint,
                           tokenizer=tokenizer)
        loader = GlobalBatchLoader(source, seed=tr.seed, dp_rank=dp_rank, dp_size=dp_size)
        # Held-out loss at the end of the run, for the corpus that has a validation split.
        val_loader = GlobalBatchLoader(
            open_source(spec.data.uri, seq_len=dims.seq_len, vocab_size=dims.vocab_size, seed=tr.seed,
                        split="validation", tokenizer=tokenizer), seed=tr.seed, dp_rank=dp_rank, dp_size=dp_size,
        ) if spec.data.uri == "builtin:pydoc" and not spec.data.sources else None

        from kiln.trainer.checkpoint import Checkpointer, install_sigterm_handler

        if threading.current_thread() is threading.main_thread():
            install_sigterm_handler()  # SIGTERM (preemption, Ctrl-C in `kiln run`) -> save, then stop
        default_uri = checkpoint_uri or (f"file://{(output_dir / 'checkpoints').resolve()}" if output_dir else None)
        checkpointer = Checkpointer(spec.checkpoint, default_uri=default_uri, rank=rank, world_size=world) \
            if checkpointing else _NoCheckpoints()
        if checkpointing and hasattr(hooks.state.get("guards"), "record_incidents"):
            hooks.state["guards"].record_incidents(checkpointer.store)  # SDC mismatches outlive the process
        start_step, tokens_seen = 0, 0
        ft = None
        if ft_enabled(spec):  # replica groups: a group that joins live peers heals from one, not from a commit
            from kiln.trainer.ft import ReplicaGroups

            ft = ReplicaGroups(spec, rank=rank, world=world, device=device, model_parts=model_parts,
                               optimizers=optimizers, snapshot=lambda: trainer_state_now())
            if spec.model.from_:  # overwritten below by a peer's or a commit's weights, if there are any
                hf.load_weights(model, spec.model.from_, dims, endpoint=hf.storage_endpoint(spec))
        state = ft.join() if ft is not None else None
        from_checkpoint = state is None
        if state is None:
            state = checkpointer.restore(model_parts, optimizers)
        if state is None and spec.model.from_ and ft is None:  # a new run starts from the model folder; a resumed one from its commit
            hf.load_weights(model, spec.model.from_, dims, endpoint=hf.storage_endpoint(spec))
        elif state is None and ft is None:  # a new run; a resumed one skips it: the commit holds every weight
            model.init_weights(tr.seed)
        if state is not None:
            start_step, tokens_seen = _resume(state, loader, device, hooks)
        if ft is not None:
            ft.restored(start_step, from_checkpoint=from_checkpoint and state is not None)
        reporter = StatusReporter.from_env(tr.steps, rank=rank, restored=state)  # rank 0 → status
        startup["restored"] = time.time()

        global_tokens = tr.global_batch_size * dims.seq_len
        flops_step = flops_per_token(dims) * global_tokens
        peak = peak_flops(device, tr.precision)  # None: no known peak, no MFU (kiln.trainer.metrics)
        logger = MetricsLogger(output_dir, rank=rank, total_steps=tr.steps, start_step=start_step,
                               exporter=_exporter(spec_doc.metadata.name) if rank == 0 else None)
        timer = StepTimer(device)
        losses: list[float] = []
        plan_steps = {p.until_step for p in spec.elastic.plan if p.until_step is not None}

        def trainer_state_now() -> dict:  # replica groups: what a healing peer receives, as a commit carries it
            return {"step": step, "tokens_seen": tokens_seen, "data": loader.state_dict(),
                    "rng": _rng_state(device), "lr": lr_at(step, tr), "layout": layout.as_dict(),
                    "model": dims.model_dump(), "goodput": reporter.state_dict(),
                    "hooks": {name: obj.state_dict() for name, obj in hooks.state.items()}}

        try:
            step = start_step
            while step < tr.steps:
                if ft is not None and (healed := ft.begin_step(step)) is not None:  # fell behind: a peer's state
                    step, tokens_seen = _resume(healed, loader, device, hooks)
                    if step >= tr.steps:
                        break
                step += 1
                timer.start()
                if ft is not None:  # this group's slot in the quorum's share of the batch
                    inputs, targets = (t.to(device) for t in ft.next_batch(loader, dp_rank, dp_size))
                else:
                    inputs, targets = (t.to(device) for t in loader.next_batch(tr.global_batch_size))
                timer.mark("data_s")
                lr = lr_at(step, tr)
                set_lr(optimizer, lr)
                # chat data: the loss is the mean over the global batch's assistant tokens (kiln.trainer.loss)
                denominator = global_count(targets, layout) if loader.masked else None
                if schedule is not None:
                    pp_loss.denominator = denominator
                    local_loss = _pipeline_step(schedule, inputs, targets, is_first, is_last)
                else:
                    local_loss = _accumulate_step(model, inputs, targets, layout, denominator)
                timer.mark("fwd_bwd_s")
                if ft is not None:  # average with the live groups before clipping: every group clips alike
                    ft.average_gradients(model_parts)
                params = [p for part in model_parts for p in part.parameters()]
                grad_norm = clip_grad_norm_(params, tr.grad_clip, pp_group=pp_group)
                loss = _global_loss(local_loss if reports_loss else None, layout, device)
                if ft is not None:
                    loss = ft.average_loss(loss)
                    if not ft.commit(loader):  # a group failed mid-step: nobody steps, redo it with the next quorum
                        optimizer.zero_grad(set_to_none=True)
                        step -= 1
                        continue
                tokens_seen += global_tokens if ft is None else ft.step_tokens(dims.seq_len)
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm)}
                if denominator is not None:  # the tokens the loss was taken on (tokens_seen counts all)
                    record["assistant_tokens"] = int(denominator)
                if ft is not None:
                    record.update(ft.metrics())
                ctx = StepContext(step, loss, float(grad_norm), model_parts, optimizers, mesh, record)
                if all(hook(ctx) for hook in hooks.before_update):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                for hook in hooks.after_update:
                    hook(ctx)
                if ctx.rollback:  # repeated loss spikes: back to the last commit; the loader keeps its
                    # cursor, skipping the bad data; hook state (guard counters) is not rolled back
                    state = checkpointer.restore(model_parts, optimizers)
                    if state is not None:
                        step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
                        _set_rng_state(state["rng"], device)
                    record["rolled_back_to"] = step
                timer.mark("optim_s")
                losses.append(loss)
                if ft is not None and step == tr.steps:  # every group must end with the same weights
                    record["ft_weights_digest"] = ft.weights_digest()

                step_s = sum(timer.times.values())
                record.update(timer.times, step_s=step_s, tokens_per_second=global_tokens / step_s,
                              mfu=flops_step / step_s / (peak * world) if peak else None,
                              world_size=world, global_batch_tokens=global_tokens,
                              tokens_seen=tokens_seen, peak_memory_gib=peak_memory_gib(device), **layout.as_dict())
                if (mix := loader.mix()) is not None:
                    record["data_mix"] = mix
                if startup is not None:  # the first step of this process (compile, if any, happens in it)
                    record["startup"], startup = {**startup, "first_step_done": time.time()}, None
                ckpt = checkpointer.status()  # before the save: it carries the time counters
                if "intervalSteps" in ckpt:  # checkpoint freshness in steps, for alerts that follow progress
                    record["checkpoint_interval_steps"] = ckpt["intervalSteps"]
                    record["steps_since_commit"] = step - (ckpt.get("lastCheckpoint") or {}).get("step", start_step)
                reporter.update(record, ckpt)
                stop = checkpointer.stop_requested(step)
                final = step == tr.steps or stop
                # elastic.plan switches the node count once its untilStep is committed: always commit it
                # replica groups: one writer, the group at replica rank 0 of this step's quorum
                if (final or step in plan_steps or checkpointer.should_save(step)) and \
                        (ft is None or ft.writes_checkpoints):
                    trainer_state = {"step": step, "tokens_seen": tokens_seen, "data": loader.state_dict(),
                                     "rng": _rng_state(device), "lr": lr, "layout": layout.as_dict(),
                                     "model": dims.model_dump(), "goodput": reporter.state_dict(),
                                     "hooks": {name: obj.state_dict() for name, obj in hooks.state.items()}}
                    checkpointer.save(step, model_parts, optimizers, trainer_state, final=final)
                    record["checkpoint_stall_s"] = checkpointer.last_blocking_s + checkpointer.last_wait_s
                    reporter.stalled(record["checkpoint_stall_s"])
                if step == tr.steps and val_loader is not None:
                    record["val_loss"] = _evaluate(model, schedule, val_loader, tr.global_batch_size, layout,
                                                   device, is_first, is_last, reports_loss)
                if step % tr.log_every == 0 or final:
                    logger.log(record)
                elif "gpu_health" in record:  # the gauge follows every health reading, logged or not
                    logger.export(record)
                if stop:
                    if rank == 0:
                        print(f"kiln: stop requested; saved step {step}, rerun to resume", flush=True)
                    break
            checkpointer.wait()
        finally:
            checkpointer.close()
            reporter.close(checkpointer.status())
            logger.close()
            if ft is not None:
                ft.close()
        if dist.is_initialized():
            # Every rank leaves together, after rank 0's last commit, status report and log lines: on a
            # cluster, the first worker pod to exit 0 ends the elastic job, and a pod still running then
            # may be stopped.
            dist.barrier()
        return TrainResult(start_step, step, losses)  # `step`, not a count: a rollback re-runs steps
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def ft_enabled(spec) -> bool:
    ft = spec.elastic.fault_tolerance
    return ft is not None and ft.mode == "replicaGroups"


def _resume(state: dict, loader: GlobalBatchLoader, device: torch.device, hooks: StepHooks) -> tuple[int, int]:
    """Continue from a trainer state (a commit's, or a live peer's): data cursor, RNG, hook state.
    Returns (step, tokens_seen)."""
    step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
    loader.load_state_dict(state["data"])
    _set_rng_state(state["rng"], device)
    saved_hooks = state.get("hooks", {})
    for name, obj in hooks.state.items():
        obj.load_state_dict(saved_hooks.get(name))
    return step, tokens_seen


class _NoCheckpoints:
    """The Checkpointer interface when checkpointing is off: nothing to restore, nothing saved."""

    last_blocking_s = last_wait_s = 0.0

    def restore(self, model_parts, optimizers):
        return None

    def should_save(self, step: int) -> bool:
        return False

    def status(self) -> dict:
        return {}

    def stop_requested(self, step: int) -> bool:
        return False

    def save(self, *args, **kwargs) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


def _exporter(run: str):
    """Prometheus metrics on rank 0 when KILN_METRICS_PORT is set (the operator sets it in pods)."""
    port = os.environ.get(contract.METRICS_PORT)
    if not port:
        return None
    from kiln.trainer.exporter import TrainerExporter

    exporter = TrainerExporter(run)
    exporter.start(int(port))
    return exporter


EVAL_BATCHES = 4


@torch.no_grad()
def _evaluate(model, schedule, loader: GlobalBatchLoader, global_batch: int, layout: Layout, device,
              is_first: bool, is_last: bool, reports_loss: bool) -> float:
    """Mean loss over the first EVAL_BATCHES global batches of the validation split (the same every time)."""
    loader.samples_seen = 0
    total = 0.0
    for _ in range(EVAL_BATCHES):
        inputs, targets = (t.to(device) for t in loader.next_batch(global_batch))
        if schedule is not None:
            losses: list[torch.Tensor] = []
            schedule.eval(*((inputs,) if is_first else ()), **({"target": targets, "losses": losses} if is_last else {}))
            local = torch.stack(losses).mean() if is_last else None
        else:
            m = layout.micro_batch
            local = torch.stack([model(inputs[i:i + m], targets[i:i + m]) for i in range(0, len(inputs), m)]).mean()
        total += _global_loss(local if reports_loss else None, layout, device)
    return total / EVAL_BATCHES


def _accumulate_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, layout: Layout,
                     denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Forward/backward over grad_accum microbatches; gradients average over them (and over dp, by FSDP), or
    with a `denominator` sum over the global batch's loss-carrying tokens (kiln.trainer.loss)."""
    total = torch.zeros((), device=inputs.device)
    m = layout.micro_batch
    for i in range(layout.grad_accum):
        # Reduce gradients across data parallel only once, after the last microbatch.
        if hasattr(model, "set_requires_gradient_sync"):  # no data-parallel wrapper at dp 1: nothing to sync
            model.set_requires_gradient_sync(i == layout.grad_accum - 1)
        batch = targets[i * m:(i + 1) * m]
        loss = microbatch_loss(model(inputs[i * m:(i + 1) * m], batch), batch, denominator, layout, layout.grad_accum)
        loss.backward()
        total += loss.detach()
    return total


def _pipeline_step(schedule, inputs, targets, is_first: bool, is_last: bool) -> torch.Tensor | None:
    """One 1F1B pass over this rank's batch; the last stage returns the mean microbatch loss."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if is_first else ()
    kwargs = {"target": targets, "losses": losses} if is_last else {}
    schedule.step(*args, **kwargs)
    return torch.stack([l.detach() for l in losses]).mean() if is_last else None


def _global_loss(local: torch.Tensor | None, layout: Layout, device: torch.device) -> float:
    """The mean loss over data-parallel replicas, the same on every rank."""
    value = local.detach().float().reshape(()) if local is not None else torch.zeros((), device=device)
    if layout.world > 1:
        value = value.clone()
        dist.all_reduce(value)
    return float(value) / layout.dp
