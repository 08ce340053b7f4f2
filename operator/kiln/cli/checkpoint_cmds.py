"""`kiln eval` (the held-out loss of a run's newest committed checkpoint, in this process) and `kiln export`
(that checkpoint as a Hugging Face model folder or a peft adapter folder, docs/models.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kiln.api import TrainingSpec
from kiln.api.load import load_one
from kiln.errors import KilnError


def eval_checkpoint_uri(doc: TrainingSpec, *, output: str | None, checkpoint: str | None) -> str:
    """Where `kiln eval` reads: --checkpoint, else where `kiln run` saved: the spec's checkpoint.uri, else
    file://OUTPUT/checkpoints."""
    if checkpoint:
        return checkpoint
    if doc.spec.checkpoint.uri:
        return doc.spec.checkpoint.uri
    folder = Path(output or f"runs/{doc.metadata.name}")
    return f"file://{(folder / 'checkpoints').resolve()}"


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from kiln.trainer.evaluate import evaluate

    doc = load_one(args.spec)
    uri = eval_checkpoint_uri(doc, output=args.output, checkpoint=args.checkpoint)
    try:
        device = torch.device(args.device) if args.device else None
    except RuntimeError as err:
        raise KilnError(f"--device {args.device}: {err}; use cpu, cuda or cuda:N") from None
    result = evaluate(doc, checkpoint_uri=uri, batches=args.batches, device=device, data_uri=args.data,
                      endpoint=args.endpoint)
    print(f"kiln: step {result.step} of {uri}: held-out loss {result.loss:.4f}, perplexity "
          f"{result.perplexity:.2f} over {result.tokens:,} tokens", flush=True)
    if args.json:
        path = Path(args.json)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
        except OSError as err:
            raise KilnError(f"--json {path}: cannot write ({err.strerror})") from None
    if args.max_loss is not None and not result.loss <= args.max_loss:
        raise KilnError(f"held-out loss {result.loss:.4f} of step {result.step} is above --max-loss {args.max_loss}")
    return 0


def parse_size(text: str) -> int:
    """'500MB', '2GB', '1048576' -> bytes (decimal units, as transformers' max_shard_size)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * factor)
    if t.isdigit():
        return int(t)
    raise KilnError(f"--max-shard-size {text!r}: use a size like 500MB or 2GB")


def cmd_export(args: argparse.Namespace) -> int:
    from kiln.trainer.model.hf_export import export_hf

    doc = load_one(args.spec)
    max_bytes = parse_size(args.max_shard_size)
    if max_bytes < 1:
        raise KilnError(f"--max-shard-size must be positive, not {args.max_shard_size}")
    if not args.output.startswith(("file://", "s3://")):
        raise KilnError(f"--output {args.output}: use file:///path/ or s3://bucket/prefix/")
    uri = eval_checkpoint_uri(doc, output=args.run_output, checkpoint=args.checkpoint)
    if args.format == "peft":
        from kiln.trainer.model.peft_folder import export_peft

        if args.merge or args.dtype:
            raise KilnError("--merge and --dtype go with --format hf; --format peft writes the fp32 adapters")
        result = export_peft(doc, checkpoint_uri=uri, output_uri=args.output, endpoint=args.endpoint)
    else:
        result = export_hf(doc, checkpoint_uri=uri, output_uri=args.output, endpoint=args.endpoint,
                           dtype=args.dtype, max_shard_bytes=max_bytes, merge=args.merge)
    print(f"kiln: exported step {result.step} of {uri} to {result.output}: {len(result.files)} files, "
          f"{result.bytes / 1e6:,.1f} MB", flush=True)
    if args.track:
        track_export(doc, result, checkpoint_uri=uri, endpoint=args.endpoint or doc.spec.checkpoint.endpoint,
                     fmt=args.format, wandb_dir=args.run_output)
    return 0


def track_export(doc, result, *, checkpoint_uri: str, endpoint: str | None, fmt: str, wandb_dir: str | None) -> None:
    """`kiln export --track`: the written folder (read back when it is on S3) to the run's tracked run(s)."""
    import tempfile

    from kiln.storage.store import open_store
    from kiln.trainer.observe.tracking import log_export

    checkpoints = open_store(checkpoint_uri, endpoint=endpoint)
    output = open_store(result.output, endpoint=endpoint)
    with tempfile.TemporaryDirectory(prefix="kiln-export-") as tmp:
        folder = output.local_path("")
        if folder is None:  # on S3: a local copy for the tracker's client to upload
            folder = Path(tmp)
            for key in result.files:
                output.get_file(key, folder / key)
        try:
            said = log_export(doc, store=checkpoints, folder=folder, files=result.files, step=result.step, fmt=fmt,
                              wandb_dir=wandb_dir)
        except KilnError as err:  # the export itself is written and stays
            raise KilnError(f"{err}; the export itself is at {result.output}") from None
    for line in said:
        print(f"kiln: tracked: {line}", flush=True)
