"""`kiln data prepare`: tokenize documents or conversations into the token shards data.uri reads."""

from __future__ import annotations

import argparse
import contextlib

from kiln.errors import KilnError


@contextlib.contextmanager
def prepare_progress(console):
    """A progress bar of `kiln data prepare` on `console` (input files done of all, documents kept, shards
    written, drawn after every tokenized batch); yields the callback prepare() takes. Off when the console
    is not a terminal: rich draws nothing there, and being transient it leaves nothing behind on one."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("kiln data prepare"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
                  TextColumn("{task.fields[docs]:,} documents kept, {task.fields[shards]:,} shards"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("prepare", total=None, docs=0, shards=0)
        # drawn at each call, not only at rich's next tick: a batch is far apart from the next on a big input
        yield lambda done, total, docs, shards: bar.update(task, completed=done, total=total, docs=docs,
                                                           shards=shards, refresh=True)


def quality_options(pr: argparse.ArgumentParser) -> None:
    """kiln.trainer.data.quality's filters (DataTrove's), in one process and with --workers."""
    pr.add_argument("--gopher", action="store_true", help="drop what DataTrove's Gopher quality heuristics drop")
    pr.add_argument("--c4", action="store_true", help="DataTrove's C4 quality filter (drops documents, removes lines)")
    pr.add_argument("--languages", nargs="+", default=None, help="keep documents in these languages (fastText "
                    "language ID, DataTrove's LanguageFilter), e.g. en de; needs --language-model")
    pr.add_argument("--language-model", default=None, help="a fastText language-ID model (lid.176.bin) at "
                    "file:///path or s3://: kiln downloads nothing")
    pr.add_argument("--language-threshold", type=float, default=0.65, help="least language score kept (default 0.65)")


def quality_settings(args: argparse.Namespace) -> dict | None:
    """kiln.trainer.data.quality's settings from the flags; None when no quality filter is asked for."""
    if not (args.gopher or args.c4 or args.languages):
        return None
    return {"gopher": args.gopher, "c4": args.c4, "languages": args.languages, "language_model": args.language_model,
            "language_threshold": args.language_threshold}


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from kiln.trainer.data.prepare import prepare

    if args.shard_tokens < 1 or args.min_chars < 0 or (args.max_doc_bytes is not None and args.max_doc_bytes < 1):
        raise KilnError("--shard-tokens and --max-doc-bytes must be at least 1 and --min-chars at least 0")
    if not args.output.startswith(("file://", "s3://")):
        raise KilnError(f"--output {args.output}: use file:///path/ or s3://bucket/prefix/")
    if args.workers is not None:
        from kiln.cli.data_jobs import cmd_prepare_workers

        if args.workers < 1 or args.format != "text":
            raise KilnError("--workers: at least 1, and for --format text only")
        return cmd_prepare_workers(args)
    from rich.console import Console

    with prepare_progress(Console(stderr=True)) as progress:
        result = prepare(args.input, tokenizer_uri=args.tokenizer, output=args.output, text_field=args.text_field,
                         min_chars=args.min_chars, dedup=args.dedup, minhash_threshold=args.minhash_threshold,
                         eos=args.eos, shard_tokens=args.shard_tokens, endpoint=args.endpoint, format=args.format,
                         quality=quality_settings(args), progress=progress,
                         **({} if args.max_doc_bytes is None else {"max_doc_bytes": args.max_doc_bytes}))
    if result is not None:
        removed = ", ".join(f"{k} {v}" for k, v in sorted(result.removed.items())) or "nothing"
        print(f"kiln: {result.documents_out:,} of {result.documents_in:,} documents, {result.tokens:,} tokens in "
              f"{len(result.shards)} shard(s) at {args.output}; removed: {removed}", flush=True)
    return 0


def cluster_options(pr: argparse.ArgumentParser) -> None:
    """`kiln data prepare --workers N`: the stages as Indexed Jobs (kiln.cli.data_jobs, docs/models.md)."""
    pr.add_argument("--workers", type=int, default=None, help="run on the cluster: each stage an Indexed Job of up "
                    "to N pods (inputs, tokenizer and output on s3://); without it, here in one process")
    pr.add_argument("--partitions", type=int, default=16, help="with --workers: exact-dedup hash partitions")
    pr.add_argument("--spec", default=None, help="with --workers: a TrainingSpec file whose namespace, image, "
                    "checkpoint.endpoint, checkpoint.credentialsSecret, "
                    "resources.nodeSelector and tolerations the pods use")
    pr.add_argument("-n", "--namespace", default=None, help="with --workers: namespace of the Jobs")
    pr.add_argument("--image", default=None, help="with --workers: the pods' image (default: the trainer image)")
    pr.add_argument("--credentials-secret", default=None, help="with --workers: Secret with AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY for the pods")
    pr.add_argument("--detach", action="store_true", help="with --workers: submit and return; `kiln data status` "
                    "follows it")
    pr.add_argument("--keep", action="store_true", help="with --workers: keep the finished Jobs and work/ folder")
    pr.add_argument("--kubeconfig", default=None)
    pr.add_argument("--context", default=None)


def status_parser(data_sub) -> None:
    st = data_sub.add_parser("status", help="the stages of a `kiln data prepare --workers N`; submits the next "
                             "stage of a --detach'ed one")
    st.add_argument("--output", required=True, help="the preparation's s3://bucket/prefix/")
    st.add_argument("--endpoint", default=None, help="S3 endpoint URL")
    st.add_argument("--kubeconfig", default=None)
    st.add_argument("--context", default=None)
    st.set_defaults(func=cmd_data_status)


def cmd_data_status(args: argparse.Namespace) -> int:
    from kiln.cli.data_jobs import cmd_status

    return cmd_status(args)
