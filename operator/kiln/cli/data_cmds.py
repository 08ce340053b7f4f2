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


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from kiln.trainer.data.prepare import prepare

    if args.shard_tokens < 1 or args.min_chars < 0 or (args.max_doc_bytes is not None and args.max_doc_bytes < 1):
        raise KilnError("--shard-tokens and --max-doc-bytes must be at least 1 and --min-chars at least 0")
    if not args.output.startswith(("file://", "s3://")):
        raise KilnError(f"--output {args.output}: use file:///path/ or s3://bucket/prefix/")
    from rich.console import Console

    with prepare_progress(Console(stderr=True)) as progress:
        result = prepare(args.input, tokenizer_uri=args.tokenizer, output=args.output, text_field=args.text_field,
                         min_chars=args.min_chars, dedup=args.dedup, minhash_threshold=args.minhash_threshold,
                         eos=args.eos, shard_tokens=args.shard_tokens, endpoint=args.endpoint, format=args.format,
                         progress=progress,
                         **({} if args.max_doc_bytes is None else {"max_doc_bytes": args.max_doc_bytes}))
    if result is not None:
        removed = ", ".join(f"{k} {v}" for k, v in sorted(result.removed.items())) or "nothing"
        print(f"kiln: {result.documents_out:,} of {result.documents_in:,} documents, {result.tokens:,} tokens in "
              f"{len(result.shards)} shard(s) at {args.output}; removed: {removed}", flush=True)
    return 0
