"""Held-out loss of a committed checkpoint, in one process (`kiln eval`).

The checkpoint may come from any world size and parallel layout: DCP reshards the FQN-keyed model state into
the plain, single-process model (the optimizer state is not read). The loss is taken over the same batches
the training loop's `val_loss` uses: the first `batches` global batches of the data's validation split, in the
loader's seeded order, so the same checkpoint always scores the same and a run's logged `val_loss` can be
checked against it.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from kiln.api import ModelDims, TrainingSpec
from kiln.errors import KilnError
from kiln.trainer.model import hf_folder as hf, kernels
from kiln.trainer.data.loader import GlobalBatchLoader, open_source
from kiln.trainer.model.loss import IGNORE, global_loss
from kiln.trainer.model.transformer import build_model
from kiln.trainer.parallel.microbatches import microbatch_losses, pipeline_step

EVAL_BATCHES = 4  # global batches of the validation split: the trainer's val_loss and `kiln eval`'s default

# Sources whose validation split is held out from training (data.py): other URIs need their own held-out data.
HELD_OUT = ("builtin:pydoc", "synthetic")


@dataclass(frozen=True)
class EvalResult:
    step: int  # the checkpoint's step (0 for an untrained model)
    loss: float  # mean next-token cross-entropy over the held-out tokens (nats)
    tokens: int  # tokens scored
    checkpoint: str | None = None  # where the weights came from

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # exp overflows a float past ~709

    def as_dict(self) -> dict:
        return {"step": self.step, "loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens,
                "checkpoint": self.checkpoint}


def model_dims(doc: TrainingSpec, endpoint: str | None = None) -> ModelDims:
    return hf.resolve_dims(doc.spec, endpoint=endpoint)


def validation_loader(doc: TrainingSpec, dims: ModelDims, data_uri: str | None = None,
                      endpoint: str | None = None) -> GlobalBatchLoader:
    """The loader over the validation split of the spec's data (or of `data_uri`, a folder of held-out shards).

    Token shards (file://, s3://) have no split of their own: evaluating on them would score the training data,
    so they need `data_uri`.
    """
    tr, uri = doc.spec.training, data_uri or doc.spec.data.uri
    if data_uri is None and doc.spec.data.sources:
        raise KilnError("data.sources mixes datasets and the mix has no held-out split; pass held-out token shards "
                        "with --data file:///path/ or s3://bucket/prefix/")
    if data_uri is None and uri not in HELD_OUT:
        raise KilnError(f"data.uri {uri} has no held-out split (only {' and '.join(HELD_OUT)} do); pass the "
                        f"held-out token shards with --data file:///path/ or s3://bucket/prefix/")
    tokenizer = hf.training_tokenizer(doc.spec, dims)
    try:
        source = open_source(uri, seq_len=dims.seq_len, vocab_size=dims.vocab_size, seed=tr.seed,
                             split="validation",
                             endpoint=os.environ.get("KILN_DATA_ENDPOINT") or endpoint or doc.spec.checkpoint.endpoint,
                             tokenizer=tokenizer, chat=doc.spec.data.format == "chat")
    except KilnError as err:
        raise KilnError(f"--data: {err}" if data_uri else str(err)) from None
    return GlobalBatchLoader(source, seed=tr.seed)


def initial_model(doc: TrainingSpec, dims: ModelDims, device: torch.device, endpoint: str | None = None,
                  load_from: bool = True) -> nn.Module:
    """The plain model with the weights training starts from (model.from's, else seeded by parameter name), in
    eval mode; with spec.model.adapter, LoRA adapters at their initial values on the frozen base. load_from=False
    skips reading model.from (a checkpoint replaces the weights anyway; for LoRA only the adapters)."""
    kernels.set_mode(doc.spec.parallelism.kernels)
    model = build_model(dims)
    adapter = doc.spec.model.adapter
    if adapter is not None:
        from kiln.trainer.model.lora import apply_lora, init_adapters

        apply_lora(model, adapter)
    model.to_empty(device=device)
    if doc.spec.model.from_:
        model.init_buffers()
        if load_from:
            hf.load_weights(model, doc.spec.model.from_, dims, endpoint=endpoint or hf.storage_endpoint(doc.spec))
    else:
        model.init_weights(doc.spec.training.seed)
    if adapter is not None:
        init_adapters(model, doc.spec.training.seed)
    return model.eval()


def load_checkpoint(model: nn.Module, doc: TrainingSpec, uri: str, endpoint: str | None = None) -> int:
    """Load the newest intact committed step under `uri` into `model`; its step. KilnError naming `uri` when
    there is none (a damaged newest commit falls back to the one before, as a resuming run does)."""
    from kiln.trainer.checkpoint.checkpointer import Checkpointer
    from kiln.trainer.model.lora import check_base
    from kiln.trainer.model.peft_folder import adapter_record

    spec = doc.spec.checkpoint.model_copy(update={"uri": uri, "endpoint": endpoint or doc.spec.checkpoint.endpoint})
    adapter = adapter_record(doc.spec, model.dims, endpoint=endpoint or hf.storage_endpoint(doc.spec))
    checkpointer = Checkpointer(spec, default_uri=uri, rank=0, world_size=1)
    try:
        with warnings.catch_warnings():  # DCP warns that it loads into one process: that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            state = checkpointer.restore([model], [], check=lambda st, where: check_base(st.get("adapter"), adapter,
                                                                                           where))
    finally:
        checkpointer.close()
    if state is None:
        raise KilnError(f"no committed checkpoint under {uri} (a step counts once its COMMIT is written and "
                        f"every file matches it; see any warnings above); train first, or pass --checkpoint "
                        f"with the run's checkpoint.uri")
    return int(state["step"])


def held_out_batches(loader: GlobalBatchLoader, batches: int, global_batch: int, device: torch.device):
    """The first `batches` global batches of `loader` (this rank's share of each), from the start every time."""
    loader.samples_seen = 0
    for _ in range(batches):
        yield tuple(t.to(device) for t in loader.next_batch(global_batch))


@torch.no_grad()
def mean_loss(model: nn.Module, loader: GlobalBatchLoader, *, batches: int, global_batch: int, micro_batch: int,
              device: torch.device, autocast: torch.dtype | None = None) -> tuple[float, int]:
    """(mean loss, tokens) over the first `batches` global batches of `loader`, `micro_batch` rows at a time.

    Like the training loop: the mean of the microbatch means, averaged over the batches (every sample has
    the same length, so this is the mean over all tokens). Chat data (data.format chat): the mean over the
    assistant tokens, each microbatch's mean weighted by its count of them; `tokens` counts those.
    """
    total, tokens = 0.0, 0
    weighted, counted = 0.0, 0
    for inputs, targets in held_out_batches(loader, batches, global_batch, device):
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            parts = [p.float() for p in microbatch_losses(model, inputs, targets, micro_batch)]
        total += float(torch.stack(parts).mean())
        tokens += targets.numel()
        if loader.masked:
            counts = [int((targets[i:i + micro_batch] != IGNORE).sum()) for i in range(0, len(inputs), micro_batch)]
            weighted += sum(float(p) * c for p, c in zip(parts, counts))
            counted += sum(counts)
    if loader.masked:
        return weighted / max(counted, 1), counted
    return total / batches, tokens


@torch.no_grad()
def validation_loss(model: nn.Module, schedule, loader: GlobalBatchLoader, global_batch: int, layout, device,
                    *, is_first: bool, is_last: bool, reports_loss: bool) -> float:
    """The training run's `val_loss`, on its parallel model: the mean loss over the first EVAL_BATCHES global
    batches of the validation split (the same every time), each rank on its share of them, through the
    training step's own forward (kiln.trainer.parallel.microbatches). Plain data: the split is builtin:pydoc's (run.py)."""
    total = 0.0
    for inputs, targets in held_out_batches(loader, EVAL_BATCHES, global_batch, device):
        if schedule is not None:
            local = pipeline_step(schedule, inputs, targets, is_first, is_last, train=False)
        else:
            local = torch.stack(microbatch_losses(model, inputs, targets, layout.micro_batch)).mean()
        total += global_loss(local if reports_loss else None, layout, device)
    return total / EVAL_BATCHES


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def evaluate(doc: TrainingSpec, *, checkpoint_uri: str | None, batches: int | None = None,
             device: torch.device | None = None, data_uri: str | None = None,
             endpoint: str | None = None) -> EvalResult:
    """Held-out loss of the newest committed checkpoint under checkpoint_uri (None: the untrained model).
    `endpoint` replaces the spec's checkpoint.endpoint (the S3 server seen from here)."""
    batches = EVAL_BATCHES if batches is None else batches  # default: the trainer's val_loss batches
    if batches < 1:
        raise KilnError(f"--batches must be at least 1, not {batches}")
    device = device or default_device()
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise KilnError(f"--device {device}: this machine has {torch.cuda.device_count()} usable CUDA GPU(s); "
                        f"use --device cpu" + (" or cuda:0" if torch.cuda.device_count() else ""))
    tr = doc.spec.training
    dims = model_dims(doc, endpoint)
    loader = validation_loader(doc, dims, data_uri, endpoint)  # first: a bad data URI fails before any loading
    # a LoRA checkpoint holds the adapters only: its base is read from model.from
    model = initial_model(doc, dims, device, endpoint,
                          load_from=not checkpoint_uri or doc.spec.model.adapter is not None)
    step = load_checkpoint(model, doc, checkpoint_uri, endpoint) if checkpoint_uri else 0
    # bf16 on a GPU, as training computes; fp32 on CPU (where bf16 matmuls are slow and the run is small).
    autocast = torch.bfloat16 if tr.precision == "bf16" and device.type == "cuda" else None
    loss, tokens = mean_loss(model, loader, batches=batches, global_batch=tr.global_batch_size,
                             micro_batch=tr.micro_batch_size, device=device, autocast=autocast)
    if not math.isfinite(loss):
        raise KilnError(f"the held-out loss of step {step} under {checkpoint_uri} is {loss}: the weights are "
                        f"not usable (diverged before this checkpoint?)")
    return EvalResult(step, loss, tokens, checkpoint_uri)
