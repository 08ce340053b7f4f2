"""`kiln data prepare` in one process against its cluster stages (`--workers N`) on this machine, in the same run.

Corpus and tokenizer: bench_prepare's (pydoc paragraphs, numbered per copy; a byte-level BPE), --files files at
two sizes (--copies copies per file, then twice that: the same files, twice the documents). For each size: the one-process `prepare` (in this process), then the stages
(kiln.trainer.data.stages) with each N of --workers, every index a forked process with its JOB_COMPLETION_INDEX,
N at a time, as the Indexed Jobs run them (no pod start, no S3: what the stages themselves cost). Reported:
seconds and documents/s of each, documents/s per worker, each stage's seconds (exact, buckets and cluster are
the dedup stages), the largest traced (tracemalloc) peak of any exact or buckets index, which holds the dedup
state, and that the shards and manifest of every N are byte-identical.

    python -m tests.bench.bench_prepare_workers [--files 2 --copies 1 --workers 1 2 --dedup minhash --out docs/bench/prepare-workers.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from tests.bench.bench_prepare import make_corpus, train_tokenizer
from tests.bench.report import write_report


DEDUP = ("exact", "buckets")  # the merging stages, whose state the corpus must not grow; traced (slower) alone


def _index(output: str, stage: str, index: int, peaks: str) -> None:
    from kiln.trainer.data import stages

    os.environ["JOB_COMPLETION_INDEX"] = str(index)
    if stage in DEDUP:
        tracemalloc.start()
    stages.run_index(output, stage, index)
    if stage in DEDUP:
        Path(peaks, f"{stage}-{index}").write_text(str(tracemalloc.get_traced_memory()[1]))


def corpus_of(folder: Path, files: int, copies_per_file: int) -> int:
    """`files` .jsonl files, each `copies_per_file` of bench_prepare's numbered copies: doubling copies_per_file
    doubles the documents and leaves the number of files (the merges' runs) as it is."""
    parts = folder.with_name(folder.name + "-parts")
    docs = make_corpus(parts, files * copies_per_file)
    folder.mkdir()
    chunks = sorted(parts.iterdir())
    for f in range(files):
        with open(folder / f"part-{f:04d}.jsonl", "wb") as out:
            for c in chunks[f * copies_per_file:(f + 1) * copies_per_file]:
                out.write(c.read_bytes())
    return docs


def run_stages(output: str, workers: int, peaks: Path) -> dict[str, float]:
    """Every stage's indexes as forked processes, `workers` at a time; each stage's seconds."""
    from kiln.trainer.data import stages

    fork = multiprocessing.get_context("fork")
    plan = json.loads(Path(output.removeprefix("file://"), stages.PLAN).read_text())
    seconds = {}
    for stage in stages.STAGES:
        t0 = time.perf_counter()
        indexes = list(range(stages.count(plan, stage)))
        for at in range(0, len(indexes), workers):
            procs = [fork.Process(target=_index, args=(output, stage, i, str(peaks))) for i in indexes[at:at + workers]]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    raise RuntimeError(f"{stage}: an index failed")
        if indexes:
            seconds[stage] = time.perf_counter() - t0
    return seconds


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=1, help="copies of the pydoc paragraphs per file (then twice that)")
    ap.add_argument("--files", type=int, default=2)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--chunk-records", type=int, default=256, help="records a merge reads from a run at a time "
                    "(kiln's default is 4,096; below a run's size here, so the merge's bound is what is measured)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dedup", choices=["exact", "minhash"], default="minhash")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", default="runs/bench/prepare-workers.json")
    args = ap.parse_args(argv)
    from kiln.trainer.data import runs, stages

    runs.CHUNK_RECORDS = args.chunk_records  # the forked workers inherit it
    from kiln.trainer.data.prepare import prepare

    sizes = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-prepare-workers-") as tmp:
        root = Path(tmp)
        train_tokenizer(root / "tokenizer.json", args.vocab)
        tok = f"file://{root / 'tokenizer.json'}"
        for copies in (args.copies, 2 * args.copies):
            corpus = root / f"corpus-{copies}"
            docs = corpus_of(corpus, args.files, copies)
            size = {"files": args.files, "copies_per_file": copies, "documents": docs,
                    "corpus_bytes": sum(f.stat().st_size for f in corpus.iterdir()), "runs": {}}
            t0 = time.perf_counter()
            prepare([str(corpus)], tokenizer_uri=tok, output=f"file://{root / f'one-{copies}'}", dedup=args.dedup,
                    log=lambda m: None)
            one = time.perf_counter() - t0
            size["one_process"] = {"seconds": one, "documents_per_second": docs / one}
            digests = set()
            for n in args.workers:
                out, peaks = root / f"w{n}-{copies}", root / f"peaks-{n}-{copies}"
                peaks.mkdir()
                stages.plan([str(corpus)], f"file://{out}", tokenizer_uri=tok, workers=n, dedup=args.dedup,
                            partitions=args.partitions)
                t0 = time.perf_counter()
                seconds = run_stages(f"file://{out}", n, peaks)
                total = time.perf_counter() - t0
                dedup_peaks = [int(p.read_text()) for p in peaks.iterdir()
                               if p.name.startswith(DEDUP)]
                digests.add(digest(out))
                size["runs"][n] = {
                    "seconds": total, "documents_per_second": docs / total,
                    "documents_per_second_per_worker": docs / total / n, "stage_seconds": seconds,
                    "dedup_stage_seconds": sum(seconds.get(s, 0.0) for s in ("exact", "buckets", "cluster")),
                    "dedup_index_peak_traced_bytes": max(dedup_peaks),
                }
            size["identical_output_for_every_worker_count"] = len(digests) == 1
            sizes.append(size)
    result = {"benchmark": "prepare-workers", "dedup": args.dedup, "chunk_records": args.chunk_records, "cpus": os.cpu_count(), "sizes": sizes,
              "dedup_peak_ratio_double_corpus": {
                  n: sizes[1]["runs"][n]["dedup_index_peak_traced_bytes"] / sizes[0]["runs"][n]["dedup_index_peak_traced_bytes"]
                  for n in args.workers}}
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
