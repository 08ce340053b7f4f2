"""How a run's parts are built (kiln.trainer.run: `setup()` joins the process group, `Run.__init__` calls the
rest in this order): the process group, the model and its optimizer (meta, parallelize, allocate; the weights come
later, from a peer, a commit or the seed), the pre-flight check, the data, the checkpointer, and the Prometheus
exporter. Each builder fills in the run under construction; the steps are kiln.trainer.run's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kiln.api import contract
from kiln.api.layout import replica_group_spec
from kiln.errors import KilnError
from kiln.trainer.data.loader import GlobalBatchLoader, open_data, open_source
from kiln.trainer.model import documents, hf_folder as hf, kernels, moe
from kiln.trainer.model.loss import PipelineLoss
from kiln.trainer.model.peft_folder import adapter_record
from kiln.trainer.model.transformer import build_model, cross_entropy
from kiln.trainer.observe import preflight
from kiln.trainer.observe.gpu_health import node_name
from kiln.trainer.observe.metrics import mfu_note
from kiln.trainer.optim import build_optimizer
from kiln.trainer.parallel.parallelize import build_mesh, build_pipeline_schedule, dp_coordinates, parallelize, plan_layout

if TYPE_CHECKING:
    from kiln.trainer.run import Run


def init_distributed() -> tuple[int, int, torch.device]:
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


def build_model_parts(run: Run) -> None:
    """Shapes on meta, parallelize, then allocate on the device and initialise by parameter name."""
    spec, tr, par, device = run.spec, run.tr, run.spec.parallelism, run.device
    run.dims = dims = hf.resolve_dims(spec)  # a model folder's config.json (model.from), else the preset and fields
    run.tokenizer = hf.training_tokenizer(spec, dims)
    run.adapter = adapter_record(spec, dims, endpoint=hf.storage_endpoint(spec))  # LoRA: base identity; else None
    # elastic.faultTolerance replicaGroups: this job is one replica group, with its share of the batch
    run.layout = layout = plan_layout(replica_group_spec(spec), dims, run.world,
                                       int(os.environ.get("LOCAL_WORLD_SIZE") or run.world))
    kernels.set_mode(par.kernels)
    torch.manual_seed(tr.seed)

    run.mesh = mesh = build_mesh(layout, device.type)
    run.model = model = parallelize(build_model(dims), mesh, layout, spec)
    model.to_empty(device=device)
    model.init_buffers()  # the weights: a peer's, this run's commit, or _initial_weights
    model.train()
    if run.rank == 0:  # what runs, and what the numbers are measured against, once per run
        used = kernels.describe(device, tensor_parallel=layout.tp, dim=dims.dim, compiled=par.compile, arch=dims.arch)
        print(f"kiln: {used}", flush=True)
        print(f"kiln: {mfu_note(device, tr.precision)}", flush=True)
        if dims.moe is not None:  # grouped GEMMs or the loop, in the compute dtype
            compute = torch.bfloat16 if tr.precision == "bf16" else torch.float32
            print(f"kiln: {moe.describe(device, compute, dims.dim, dims.moe.ffn_dim)}", flush=True)
        if spec.data.packing:
            print(f"kiln: {documents.describe(device)}", flush=True)
    run.model_parts = [model]
    run.params = [p for part in run.model_parts for p in part.parameters()]  # fixed from here: clipped each step
    run.optimizer = build_optimizer(run.model_parts, tr, device)
    run.optimizers = [run.optimizer]
    run.startup["model_built"] = time.time()

    pp_rank = mesh["pp"].get_local_rank()
    run.is_first, run.is_last = pp_rank == 0, pp_rank == layout.pp - 1
    run.pp_loss = PipelineLoss(cross_entropy, layout)
    run.schedule = build_pipeline_schedule(model, mesh, layout, device, run.pp_loss) if layout.pp > 1 else None
    run.pp_group = mesh["pp"].get_group() if layout.pp > 1 else None
    # Exactly one rank per data-parallel replica reports the loss: the last stage, tensor rank 0.
    run.reports_loss = run.is_last and mesh["tp"].get_local_rank() == 0


def run_preflight(run: Run) -> None:
    """resources.preflight: every rank's matmul rate and the world's bandwidth, before anything trains
    (kiln.trainer.observe.preflight); `run.preflight` is the result, None when the check is off."""
    check = run.spec.resources.preflight
    run.preflight = preflight.check(run.device, min_relative=check.min_relative_speed, node=node_name(),
                                     matmul=run.hooks.preflight_matmul) if check.enabled else None
    if run.preflight is not None and run.rank == 0:
        preflight.say(run.preflight)
    # a slow node the elastic bounds cannot do without fails the run (every rank: the same result), on GPUs
    why = preflight.cannot_leave(run.preflight, run.spec) if run.preflight and run.device.type == "cuda" else None
    if why is not None:
        raise KilnError(why)


def build_data(run: Run) -> None:
    spec, tr, dims = run.spec, run.tr, run.dims
    run.dp_rank, run.dp_size = dp_coordinates(run.mesh)
    source = open_data(spec.data, seq_len=dims.seq_len, vocab_size=dims.vocab_size, seed=tr.seed,
                       endpoint=os.environ.get("KILN_DATA_ENDPOINT") or spec.checkpoint.endpoint,
                       tokenizer=run.tokenizer)
    run.loader = GlobalBatchLoader(source, seed=tr.seed, dp_rank=run.dp_rank, dp_size=run.dp_size)
    # Held-out loss at the end of the run, for the corpus that has a validation split.
    run.val_loader = GlobalBatchLoader(
        open_source(spec.data.uri, seq_len=dims.seq_len, vocab_size=dims.vocab_size, seed=tr.seed,
                    split="validation", tokenizer=run.tokenizer), seed=tr.seed, dp_rank=run.dp_rank,
        dp_size=run.dp_size,
    ) if spec.data.uri == "builtin:pydoc" and not spec.data.sources else None


def build_checkpointer(run: Run, checkpoint_uri: str | None, output_dir: Path | None, checkpointing: bool) -> None:
    from kiln.trainer.checkpoint.checkpointer import Checkpointer, NoCheckpoints, install_sigterm_handler

    if threading.current_thread() is threading.main_thread():
        install_sigterm_handler()  # SIGTERM (preemption, Ctrl-C in `kiln run`) -> save, then stop
    default_uri = checkpoint_uri or (f"file://{(output_dir / 'checkpoints').resolve()}" if output_dir else None)
    run.checkpointer = Checkpointer(run.spec.checkpoint, default_uri=default_uri, rank=run.rank,
                                     world_size=run.world) if checkpointing else NoCheckpoints()
    if checkpointing:
        run.hooks.record_incidents(run.checkpointer.store)  # e.g. SDC mismatches outlive the process


def start_exporter(run: str):
    """Prometheus metrics on rank 0 when KILN_METRICS_PORT is set (the operator sets it in pods)."""
    port = os.environ.get(contract.METRICS_PORT)
    if not port:
        return None
    from kiln.trainer.observe.exporter import TrainerExporter

    exporter = TrainerExporter(run)
    exporter.start(int(port))
    return exporter
