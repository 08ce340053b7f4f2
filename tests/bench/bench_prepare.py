"""`kiln data prepare` against the `tokenizers` library's own batch encoding of the same files, in the same run.

Corpus: the English help text that ships with Python (pydoc topics), cut into paragraphs, written as .jsonl
files, --copies times over (each copy's paragraphs numbered, so no two documents are equal). Tokenizer: a
byte-level BPE of --vocab tokens trained on the same text with the `tokenizers` library. Reference: read each
file, parse its lines, `Tokenizer.encode_batch` in batches of the same size (no normalising, filtering, hashing
or writing); reference_fast: the same with `encode_batch_fast` (no character offsets), which kiln uses for text.
Reported: documents and tokens per second of each, the throughput ratio kiln/reference with
dedup off, and what exact and MinHash dedup cost (kiln with dedup exact / minhash against dedup off).

    python -m tests.bench.bench_prepare [--copies 20 --vocab 8192 --repeats 3 --dedups none exact minhash]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.report import write_report


def make_corpus(folder: Path, copies: int) -> int:
    from kiln.trainer.data.loader import pydoc_bytes

    paragraphs = [p for p in pydoc_bytes().decode().split("\n\n") if p.strip()]
    folder.mkdir(parents=True)
    for c in range(copies):
        with open(folder / f"part-{c:04d}.jsonl", "w") as f:
            for i, p in enumerate(paragraphs):
                f.write(json.dumps({"text": f"{c}.{i} {p}"}) + "\n")
    return copies * len(paragraphs)


def train_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kiln.trainer.data.loader import pydoc_bytes

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([pydoc_bytes().decode()], trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(path))


def reference(files: list[Path], tokenizer_path: Path, batch: int, fast: bool = False) -> tuple[int, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    encode = tok.encode_batch_fast if fast else tok.encode_batch  # fast: without character offsets, like kiln's
    docs = tokens = 0
    for f in files:
        texts = [json.loads(line)["text"] for line in f.read_bytes().splitlines() if line.strip()]
        for i in range(0, len(texts), batch):
            tokens += sum(len(e.ids) for e in encode(texts[i:i + batch], add_special_tokens=False))
        docs += len(texts)
    return docs, tokens


def dedup_bytes_per_document(texts: list[str]) -> dict[str, float]:
    """What the dedup state grows by per kept (unique) document, measured with tracemalloc: the exact-hash set
    (prepare()'s 16-byte sha256 prefixes) and the MinHash LSH index (prepare.NearDuplicates)."""
    import hashlib
    import tracemalloc

    from kiln.trainer.data.prepare import NearDuplicates, normalise

    texts = [normalise(t) for t in texts]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    seen = {hashlib.sha256(t.encode()).digest()[:16] for t in texts}
    exact = (tracemalloc.get_traced_memory()[0] - base) / len(seen)
    near = NearDuplicates(0.8)
    base = tracemalloc.get_traced_memory()[0]
    kept = sum(not near.seen_before(t) for t in texts)
    minhash = (tracemalloc.get_traced_memory()[0] - base) / kept
    tracemalloc.stop()
    return {"exact": exact, "minhash": minhash, "documents": len(texts), "minhash_kept": kept}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dedups", nargs="+", default=["none", "exact", "minhash"], choices=["none", "exact", "minhash"])
    ap.add_argument("--out", default="runs/bench/prepare.json")
    args = ap.parse_args(argv)
    from kiln.trainer.data.prepare import prepare

    batch = 1000
    with tempfile.TemporaryDirectory(prefix="kiln-bench-prepare-") as tmp:
        root = Path(tmp)
        n_docs = make_corpus(root / "corpus", args.copies)
        train_tokenizer(root / "tokenizer.json", args.vocab)
        files = sorted((root / "corpus").glob("*.jsonl"))
        corpus_bytes = sum(f.stat().st_size for f in files)
        for f in files:
            f.read_bytes()  # page cache warm for every reader alike
        dedups = args.dedups
        times: dict[str, list[float]] = {"reference": [], "reference_fast": [],
                                         **{f"kiln_dedup_{d}": [] for d in dedups}}
        tokens: dict[str, int] = {}
        for r in range(args.repeats):
            t0 = time.perf_counter()
            _, tokens["reference"] = reference(files, root / "tokenizer.json", batch)
            times["reference"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _, tokens["reference_fast"] = reference(files, root / "tokenizer.json", batch, fast=True)
            times["reference_fast"].append(time.perf_counter() - t0)
            for dedup in dedups:
                t0 = time.perf_counter()
                res = prepare([str(root / "corpus")], tokenizer_uri=f"file://{root / 'tokenizer.json'}",
                              output=f"file://{root / f'out-{dedup}-{r}'}", dedup=dedup, batch_docs=batch,
                              log=lambda m: None)
                times[f"kiln_dedup_{dedup}"].append(time.perf_counter() - t0)
                tokens[f"kiln_dedup_{dedup}"] = res.tokens
        paragraphs = [json.loads(line)["text"] for line in files[0].read_text().splitlines()]
        dedup_bytes = dedup_bytes_per_document(paragraphs)
    med = {k: statistics.median(v) for k, v in times.items()}
    # the same work: the same tokens, but for kiln's normalising (stripped whitespace, NFC)
    assert abs(tokens["kiln_dedup_none"] - tokens["reference"]) <= 1e-4 * tokens["reference"], tokens
    result = {
        "benchmark": "prepare", "host": platform.node(), "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
        "documents": n_docs, "corpus_bytes": corpus_bytes, "tokens": tokens, "vocab": args.vocab,
        "seconds_median": med, "seconds_all": times,
        "documents_per_second": {k: n_docs / v for k, v in med.items()},
        "throughput_kiln_dedup_none_over_tokenizers": med["reference"] / med["kiln_dedup_none"],
        "throughput_kiln_dedup_none_over_tokenizers_fast": med["reference_fast"] / med["kiln_dedup_none"],
        # each repeat's pair ran back to back: their ratios show the spread the machine's load gives
        "throughput_ratio_per_repeat": [r / k for r, k in zip(times["reference"], times["kiln_dedup_none"])],
        **{f"{d}_dedup_cost": med[f"kiln_dedup_{d}"] / med["kiln_dedup_none"] - 1 for d in dedups if d != "none"},
        "dedup_state_bytes_per_kept_document": dedup_bytes,
    }
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
