"""The parsers of `kiln run`, `kiln torchrun`, `kiln train`, `kiln eval`, `kiln export` and `kiln data prepare`;
each command's code is in its own module: local_run (run), rank_cmds (torchrun, train), checkpoint_cmds (eval,
export), data_cmds (data prepare)."""

from __future__ import annotations

import argparse

from kiln.cli.checkpoint_cmds import cmd_eval, cmd_export
from kiln.cli.data_cmds import cluster_options, cmd_data_prepare, quality_options, status_parser
from kiln.cli.local_run import cmd_run
from kiln.cli.rank_cmds import cmd_torchrun, cmd_train

__all__ = ["cmd_data_prepare", "cmd_eval", "cmd_export", "cmd_run", "cmd_torchrun", "cmd_train", "debug_option",
           "register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run", help="train a TrainingSpec on this machine (torchrun with N local processes)",
        description="Train SPEC on this machine: N local processes under torchrun (CPU or GPU). Checkpoints go to "
        "file://OUTPUT/checkpoints unless the spec names a store; rerunning the same command resumes.",
    )
    run.add_argument("spec", help="TrainingSpec YAML file")
    run.add_argument("--nproc", type=int, default=None, help="local processes (default: resources.processesPerNode, "
                     "else the GPU count when gpusPerNode > 0, else 1)")
    run.add_argument("--steps", type=int, default=None, help="override training.steps")
    run.add_argument("--output", default=None, help="run folder: metrics.jsonl, tensorboard/, checkpoints/ "
                     "(default: runs/<metadata.name>)")
    debug_option(run)
    run.set_defaults(func=cmd_run)

    # Every argument belongs to torchrun ("+" is this parser's option prefix, so "--nproc-per-node" passes).
    launcher = subparsers.add_parser(
        "torchrun", prefix_chars="+", add_help=False,
        help="torchrun, exiting 128+N when stopped by signal N (what trainer pods run)",
        description="Run torchrun with these arguments. When the pod is stopped (deleted, evicted, preempted, "
        "its node drained) the ranks save and torchrun ends on the signal; this exits 128+signal instead of "
        "torchrun's 1, so the training-operator's ExitCode restart policy restarts the pod instead of failing "
        "the job.",
    )
    launcher.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    launcher.set_defaults(func=cmd_torchrun)

    train = subparsers.add_parser(
        "train", help="run one training rank (started by torchrun; reads RANK/WORLD_SIZE and the PET_* env)",
    )
    train.add_argument("--config", required=True, help="TrainingSpec YAML file (resolved spec)")
    train.add_argument("--output", default=None, help="run folder for metrics (default: runs/<metadata.name>)")
    train.add_argument("--steps", type=int, default=None, help="override training.steps")
    train.set_defaults(func=cmd_train)

    ev = subparsers.add_parser(
        "eval", help="held-out loss and perplexity of a run's newest committed checkpoint (one process, CPU or GPU)",
        description="Load the newest committed checkpoint of SPEC's run (saved by any number of processes) into "
        "this one process and score it on the validation split of the spec's data: the same batches as the "
        "val_loss the trainer logs at the end of a run. Prints the result; --json writes it.",
    )
    ev.add_argument("spec", help="TrainingSpec YAML file")
    where = ev.add_mutually_exclusive_group()
    where.add_argument("--output", default=None, help="the `kiln run` folder whose checkpoints/ to read (default: "
                       "runs/<metadata.name>; used only when the spec has no checkpoint.uri)")
    where.add_argument("--checkpoint", default=None, help="checkpoint URI (file:///path/ or s3://bucket/prefix/; "
                       "default: the spec's checkpoint.uri)")
    ev.add_argument("--batches", type=int, default=None, help="global batches of held-out data to score "
                    "(default: as many as the trainer's val_loss)")
    ev.add_argument("--data", default=None, help="held-out token shards (file:///path/ or s3://...), needed when "
                    "data.uri has no validation split of its own")
    ev.add_argument("--endpoint", default=None, help="S3 endpoint URL for the checkpoint and data (default: the "
                    "spec's checkpoint.endpoint); keys from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    ev.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: cuda when available)")
    ev.add_argument("--json", default=None, metavar="FILE",
                    help='also write {"step", "loss", "perplexity", "tokens", "checkpoint"} to FILE')
    ev.add_argument("--max-loss", type=float, default=None, metavar="X",
                    help="a gate for CI: exit 1 (after printing and writing --json) when the loss is above X")
    debug_option(ev)
    ev.set_defaults(func=cmd_eval)

    ex = subparsers.add_parser(
        "export", help="write a run's newest committed checkpoint as a Hugging Face model folder",
        description="Load the newest committed checkpoint of SPEC's run (saved by any number of processes) into "
        "this one process and write it to OUTPUT as a Hugging Face folder: sharded safetensors with their index, "
        "config.json, generation_config.json and the tokenizer files, which transformers loads as the "
        "model.from folder's family (LlamaForCausalLM for a preset). A LoRA run (spec.model.adapter): --format "
        "peft writes its adapters as a peft adapter folder, --format hf --merge the base with them merged in.",
    )
    ex.add_argument("spec", help="TrainingSpec YAML file")
    ex.add_argument("--format", choices=["hf", "peft"], default="hf",
                    help="output format: hf (a Hugging Face model folder), peft (a LoRA run's adapter folder: "
                    "adapter_config.json + adapter_model.safetensors, for peft.PeftModel.from_pretrained)")
    ex.add_argument("--merge", action="store_true",
                    help="with --format hf, for a LoRA run: the base with the adapters merged into it")
    ex.add_argument("--output", required=True, help="folder to write: file:///path/ or s3://bucket/prefix/")
    where = ex.add_mutually_exclusive_group()
    where.add_argument("--run-output", default=None, help="the `kiln run` folder whose checkpoints/ to read "
                       "(default: runs/<metadata.name>; used only when the spec has no checkpoint.uri)")
    where.add_argument("--checkpoint", default=None, help="checkpoint URI (default: the spec's checkpoint.uri)")
    ex.add_argument("--endpoint", default=None, help="S3 endpoint URL for the checkpoint, model folder and output "
                    "(default: the spec's checkpoint.endpoint); keys from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    ex.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="dtype of the written weights (default: model.from's, else float32)")
    ex.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 500MB, 5GB (default 2GB)")
    ex.add_argument("--track", action="store_true",
                    help="also log the exported folder to the run's tracked run(s) of spec.tracking (its id from "
                    "the checkpoint store): MLflow artifacts under model/, a W&B artifact of type model")
    debug_option(ex)
    ex.set_defaults(func=cmd_export)

    data = subparsers.add_parser("data", help="prepare training data (kiln data prepare)")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    pr = data_sub.add_parser(
        "prepare", help="tokenize .txt/.jsonl/.parquet files into token shards that data.uri reads",
        description="Read .txt (one document per file), .jsonl (one per line) and .parquet (one per row) files "
        "from files, folders, "
        "file:// or s3:// prefixes; normalise, filter, deduplicate exactly and tokenize them into "
        "tokens-NNNNN.npy shards and a manifest.json at OUTPUT (docs/models.md).",
    )
    pr.add_argument("--input", nargs="+", required=True, help="files, folders, file:// or s3:// prefixes")
    pr.add_argument("--tokenizer", required=True, help="a tokenizer.json or a model folder holding one")
    pr.add_argument("--output", required=True, help="folder for the shards: file:///path/ or s3://bucket/prefix/")
    pr.add_argument("--format", choices=["text", "chat"], default="text",
                    help="text: documents (default); chat: conversations ({\"messages\": [{\"role\", \"content\"}, ...]}) "
                    "rendered with the tokenizer's chat template, written with the assistant mask that data.format "
                    "chat trains on")
    pr.add_argument("--text-field", default=None,
                    help="the field of a .jsonl line (or .parquet column) holding the text (default text) or, with "
                    "--format chat, the messages (default messages)")
    pr.add_argument("--min-chars", type=int, default=1, help="drop documents shorter than this after normalising")
    pr.add_argument("--dedup", choices=["exact", "minhash", "none"], default="exact",
                    help="drop repeated documents: exact (default), minhash (exact and near-duplicates) or none")
    pr.add_argument("--minhash-threshold", type=float, default=0.8,
                    help="with --dedup minhash: estimated Jaccard similarity of word 5-grams that makes a "
                    "near-duplicate (default 0.8)")
    pr.add_argument("--eos", default=None, help="a token appended to every document, e.g. '<|end_of_text|>'")
    pr.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    pr.add_argument("--max-doc-bytes", type=int, default=None,
                    help="a .txt file or .jsonl line longer than this is skipped unread and counted as too_large "
                    "(default 32 MiB): what bounds a record's memory")
    pr.add_argument("--endpoint", default=None, help="S3 endpoint URL; keys from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    quality_options(pr)
    cluster_options(pr)
    pr.set_defaults(func=cmd_data_prepare)
    status_parser(data_sub)


def debug_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="print the traceback of an unexpected failure (by "
                        "default it goes to a file the error names)")
