"""`kiln data prepare --workers N`: the preparation as stages over a store, each index of a stage a pure function of
what earlier stages wrote (docs/models.md, "Data preparation at cluster scale"). A stage's index is what a pod of
its Indexed Job gets as JOB_COMPLETION_INDEX; locally, any process can run any index.

  scan      index w of W: every input file f with f % W == w: read, normalise, filter; its kept texts, and per
            kept document a sha256 record in exact partition p (of P) and a MinHash band record per band
  exact     index p of P: merge partition p's sorted runs; every document but the first of equal hashes is dropped
  buckets   index j of B (MinHash bands): merge band j's runs; documents sharing a band hash pair with its first
  cluster   one index: union-find over all pairs; every document but the first of each cluster is dropped
  tokenize  index w of W: file f % W == w: its texts minus the drops, tokenized, with each document's length
  shards    index w of W: shard k % W == w: global tokens [k·S, (k+1)·S) cut from the files' tokens
  manifest  one index: manifest.json, every filter's counts summed

The order is global and independent of W: input files in the order the plan lists them (inputs as given, each
folder's keys sorted), documents in file order, a document named (file number, kept index). "First" is the
smallest name, so the same documents survive whichever worker read them, and shards and manifest are byte-identical
for any W. Every index writes its outputs, then its marker work/done/STAGE/INDEX: a retried or rerun index redoes
(and overwrites identically) only what has no marker; nothing is appended, so nothing is lost or duplicated."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import struct
import sys
from collections import Counter

import numpy as np

from kiln.errors import KilnError
from kiln.storage import ObjectStore, open_store
from kiln.storage.reader import open_reader
from kiln.storage.store import ObjectNotFound
from kiln.trainer.data import prepare_clean as clean
from kiln.trainer.data import prepare_read as read
from kiln.trainer.data import prepare_write as write
from kiln.trainer.data import quality
from kiln.trainer.data.runs import Spill, merged, merged_groups, read_run, write_run
from kiln.trainer.data.shards import DOCS_PREFIX, DOCS_SUFFIX, TOKENS_PREFIX

WORK = "work/"
PLAN = WORK + "plan.json"
STAGES = ("scan", "exact", "buckets", "cluster", "tokenize", "shards", "manifest")
NAME = struct.Struct(">II")  # (file number, kept index): big-endian, so byte order is document order
READ_ERRORS = ("undecodable", "invalid_json", "missing_field", "too_large")  # records that came in, unread
TOKENIZE_BATCH = 1000  # documents a tokenize index encodes at once


def plan(inputs: list[str], output: str, *, tokenizer_uri: str, workers: int, partitions: int = 16,
         text_field: str | None = None, min_chars: int = 1, dedup: str = "exact", minhash_threshold: float = 0.8,
         eos: str | None = None, shard_tokens: int = 100_000_000, max_doc_bytes: int = read.MAX_DOC_BYTES,
         quality: dict | None = None, endpoint: str | None = None) -> dict:
    """The plan at OUTPUT/work/plan.json (written once; a rerun must give the same settings and workers): the
    settings, the input files in order, and how many indexes each stage has."""
    from kiln.trainer.data.tokenizer import load_tokenizer, vocab_size

    if workers < 1 or partitions < 1:
        raise KilnError(f"--workers {workers} / --partitions {partitions}: both must be at least 1")
    if dedup not in ("none", "exact", "minhash") or not 0 < minhash_threshold <= 1:
        raise KilnError(f"--dedup {dedup} / --minhash-threshold {minhash_threshold}: use none, exact or minhash, "
                        f"with a threshold in (0, 1]")
    tokenizer = load_tokenizer(tokenizer_uri, endpoint)
    if tokenizer is None:
        raise KilnError("--tokenizer byte: data prepare needs a tokenizer.json or a model folder holding one")
    if eos is not None and tokenizer.token_to_id(eos) is None:
        raise KilnError(f"--eos {eos!r} is not a token of {tokenizer_uri}")
    settings = {"inputs": inputs, "tokenizer": tokenizer_uri, "vocab_size": vocab_size(tokenizer),
                "text_field": text_field or "text", "min_chars": min_chars, "dedup": dedup, "eos": eos,
                "shard_tokens": shard_tokens, "max_doc_bytes": max_doc_bytes, "partitions": partitions}
    if quality:
        settings["quality"] = quality
    bands = rows = 0
    if dedup == "minhash":
        from datasketch import MinHashLSH

        lsh = MinHashLSH(threshold=minhash_threshold, num_perm=clean.MINHASH_PERMUTATIONS)  # its optimal bands
        settings["minhash_threshold"] = minhash_threshold
        bands, rows = lsh.b, lsh.r
    out = open_store(output, endpoint=endpoint)
    files = [[store.uri, key] for uri in inputs for store, key in read.input_files(uri, endpoint)]
    new = {"settings": settings, "files": files, "workers": workers, "bands": bands, "rows": rows}
    try:
        old = json.loads(out.get_bytes(PLAN))
    except ObjectNotFound:
        out.put_bytes(PLAN, json.dumps(new, indent=1).encode())
        return new
    if {k: old.get(k) for k in ("settings", "files")} != {k: new[k] for k in ("settings", "files")}:
        raise KilnError(f"--output {output} holds an unfinished preparation of other inputs or settings; use another "
                        "--output or delete that folder")
    if old["workers"] != workers:
        raise KilnError(f"--workers {workers}: {output} was started with --workers {old['workers']}; rerun with that")
    return old


def count(p: dict, stage: str) -> int:
    """How many indexes `stage` has (0: the plan's dedup setting skips it)."""
    dedup = p["settings"]["dedup"]
    return {"scan": p["workers"], "exact": p["settings"]["partitions"] if dedup != "none" else 0,
            "buckets": p["bands"], "cluster": 1 if dedup == "minhash" else 0, "tokenize": p["workers"],
            "shards": p["workers"], "manifest": 1}[stage]


def marker(stage: str, index: int) -> str:
    return f"{WORK}done/{stage}/{index:05d}.json"


def finished(out: ObjectStore, stage: str) -> list[dict]:
    """The markers of `stage`'s finished indexes (each its index's progress: documents, bytes, tokens)."""
    return [json.loads(out.get_bytes(o.key)) for o in out.list(f"{WORK}done/{stage}/")]


def run_index(output: str, stage: str, index: int, endpoint: str | None = None) -> bool:
    """Run index `index` of `stage`; False when its marker says it is already done."""
    out = open_store(output, endpoint=endpoint)
    try:
        p = json.loads(out.get_bytes(PLAN))
    except ObjectNotFound:
        raise KilnError(f"{out.url(PLAN)}: no plan; `kiln data prepare --workers N` writes it") from None
    if stage not in STAGES or not 0 <= index < count(p, stage):
        raise KilnError(f"stage {stage} has no index {index} in {out.url(PLAN)}")
    if out.exists(marker(stage, index)):
        return False
    done = globals()[f"_{stage}"](out, p, index, endpoint)
    out.put_bytes(marker(stage, index), json.dumps({"index": index, **done}).encode())
    return True


def _mine(p: dict, index: int, n: int) -> range:
    return range(index, n, p["workers"])


def _scan(out: ObjectStore, p: dict, w: int, endpoint) -> dict:
    filters = quality.make_filters(p["settings"].get("quality") or {}, endpoint)
    totals = Counter()
    for f in _mine(p, w, len(p["files"])):
        key = f"{WORK}scan/{f:06d}.json"
        if not out.exists(key):  # an interrupted index keeps its finished files
            out.put_bytes(key, json.dumps(_scan_file(out, p, f, filters, endpoint)).encode())
        done = json.loads(out.get_bytes(key))
        totals.update(documents=done["documents_in"], bytes=done["bytes"])
    return dict(totals)


def _scan_file(out: ObjectStore, p: dict, f: int, filters: list, endpoint) -> dict:
    s = p["settings"]
    root, key = p["files"][f]
    store = open_store(root if root.endswith("/") else root + "/", endpoint=endpoint)
    removed = Counter()
    exact = Spill(out, lambda part, n: f"{WORK}exact/{part:04d}/{f:06d}-{n:04d}.run")
    bands = Spill(out, lambda band, n: f"{WORK}buckets/{band:04d}/{f:06d}-{n:04d}.run")
    documents = kept = 0
    try:
        size = store.size(key)
        with open_reader(store, key) as stream, out.open_writer(f"{WORK}texts/{f:06d}.jsonl") as texts:
            for doc in read.documents(stream, key, s["text_field"], removed, str, s["max_doc_bytes"]):
                documents += 1
                text = clean.normalise(doc)
                if len(text) < s["min_chars"]:
                    removed["too_short"] += 1
                    continue
                text, why = quality.apply(filters, text)
                if text is None:
                    removed[why] += 1
                    continue
                texts.write(json.dumps(text, ensure_ascii=False).encode() + b"\n")
                name = NAME.pack(f, kept)
                kept += 1
                if s["dedup"] != "none":
                    digest = hashlib.sha256(text.encode()).digest()[:16]
                    exact.add(int.from_bytes(digest[:8], "big") % s["partitions"], digest + name)
                if s["dedup"] == "minhash":
                    values = clean.minhash(text).hashvalues.astype(">u8")
                    for j in range(p["bands"]):
                        band = values[j * p["rows"]:(j + 1) * p["rows"]].tobytes()
                        bands.add(j, hashlib.blake2b(band, digest_size=8).digest() + name)
    except (OSError, KilnError) as err:  # unreadable: refused, naming it; finished files stay
        raise KilnError(f"{store.url(key)}: cannot read it ({err})") from None
    exact.flush()
    bands.flush()
    return {"documents_in": documents + sum(removed[k] for k in READ_ERRORS), "kept": kept,
            "removed": dict(removed), "bytes": size}


def _runs(out: ObjectStore, prefix: str) -> list[str]:
    return [o.key for o in out.list(prefix) if o.key.endswith(".run")]


def _exact(out: ObjectStore, p: dict, part: int, endpoint) -> dict:
    dropped = 0
    drops = Spill(out, lambda _, n: f"{WORK}drop/exact-{part:04d}-{n:04d}.run")  # sorted by name for tokenize
    for _, rest in merged_groups(out, _runs(out, f"{WORK}exact/{part:04d}/"), 24, 16, f"{WORK}merge/exact-{part:04d}/"):
        for record in rest:
            drops.add(0, record[16:])
            dropped += 1
    drops.flush()
    return {"documents": dropped}


def _buckets(out: ObjectStore, p: dict, band: int, endpoint) -> dict:
    pairs = 0
    with out.open_writer(f"{WORK}pairs/{band:04d}.bin") as sink:
        for first, rest in merged_groups(out, _runs(out, f"{WORK}buckets/{band:04d}/"), 16, 8,
                                         f"{WORK}merge/buckets-{band:04d}/"):
            for record in rest:
                sink.write(first[8:] + record[8:])
                pairs += 1
    return {"documents": pairs}


def _cluster(out: ObjectStore, p: dict, _: int, endpoint) -> dict:
    """Union-find over the pairs, each cluster rooted at its smallest name; memory grows with the documents that
    have a near-duplicate, not with the corpus."""
    parent: dict[bytes, bytes] = {}

    def root(x: bytes) -> bytes:
        top = x
        while (up := parent.get(top, top)) != top:
            top = up
        while x != top:
            parent[x], x = top, parent[x]
        return top

    for o in out.list(f"{WORK}pairs/"):
        for record in read_run(out, o.key, 16):
            a, b = root(record[:8]), root(record[8:])
            if a != b:
                parent[max(a, b)] = min(a, b)
    drops = sorted(x for x in parent if root(x) != x)
    write_run(out, f"{WORK}drop/near.run", drops)
    return {"documents": len(drops)}


class _Dropped:
    """Dropped names in ascending order, asked about in ascending order (a worker's files, each file's documents):
    the drops are streamed past, never held."""

    def __init__(self, names):
        self.names = iter(names)
        self.head = next(self.names, None)

    def __contains__(self, name: bytes) -> bool:
        while self.head is not None and self.head < name:
            self.head = next(self.names, None)
        return self.head == name


def _tokenize(out: ObjectStore, p: dict, w: int, endpoint) -> dict:
    from kiln.trainer.data.tokenizer import load_tokenizer

    s = p["settings"]
    tokenizer = load_tokenizer(s["tokenizer"], endpoint)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    tail = [tokenizer.token_to_id(s["eos"])] if s["eos"] is not None else []
    dtype = write.token_dtype(s["vocab_size"]).newbyteorder("<")
    exact = _Dropped(merged(out, _runs(out, f"{WORK}drop/exact-"), 8, f"{WORK}merge/drop-{w:05d}/"))
    near = _Dropped(merged(out, _runs(out, f"{WORK}drop/near"), 8, f"{WORK}merge/near-{w:05d}/"))
    totals = Counter()
    for f in _mine(p, w, len(p["files"])):
        key = f"{WORK}tokens/{f:06d}.json"
        if not out.exists(key):
            removed = Counter()
            kept = tokens = 0
            with (open_reader(out, f"{WORK}texts/{f:06d}.jsonl") as texts,
                  out.open_writer(f"{WORK}tokens/{f:06d}.tokens") as tok,
                  out.open_writer(f"{WORK}tokens/{f:06d}.lengths") as lengths):
                batch: list[str] = []

                def flush() -> None:
                    nonlocal tokens
                    docs = [e.ids + tail for e in encode(batch, add_special_tokens=False)] if batch else []
                    for d in docs:
                        tok.write(np.asarray(d, dtype=dtype).tobytes())
                    lengths.write(np.asarray([len(d) for d in docs], dtype="<u4").tobytes())
                    tokens += sum(len(d) for d in docs)
                    batch.clear()

                for i, line in enumerate(texts):
                    name = NAME.pack(f, i)
                    if name in exact:
                        removed["duplicate"] += 1
                    elif name in near:
                        removed["near_duplicate"] += 1
                    else:
                        batch.append(json.loads(line))
                        kept += 1
                        if len(batch) >= TOKENIZE_BATCH:
                            flush()
                flush()
            out.put_bytes(key, json.dumps({"documents": kept, "tokens": tokens, "removed": dict(removed)}).encode())
        done = json.loads(out.get_bytes(key))
        totals.update(documents=done["documents"], tokens=done["tokens"])
    return dict(totals)


def _file_tokens(out: ObjectStore, p: dict) -> list[dict]:
    return [json.loads(out.get_bytes(f"{WORK}tokens/{f:06d}.json")) for f in range(len(p["files"]))]


def _shards(out: ObjectStore, p: dict, w: int, endpoint) -> dict:
    size = p["settings"]["shard_tokens"]
    dtype = write.token_dtype(p["settings"]["vocab_size"]).newbyteorder("<")
    counts = [d["tokens"] for d in _file_tokens(out, p)]
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    tokens = 0
    for k in range(w, math.ceil(int(offsets[-1]) / size), p["workers"]):
        lo, hi = k * size, min((k + 1) * size, int(offsets[-1]))
        parts, starts = [], []
        for f in range(len(counts)):
            a, b = max(lo, int(offsets[f])), min(hi, int(offsets[f + 1]))
            if a >= b:
                continue
            base = int(offsets[f])
            raw = out.get_bytes(f"{WORK}tokens/{f:06d}.tokens", (a - base) * dtype.itemsize, (b - a) * dtype.itemsize)
            parts.append(np.frombuffer(raw, dtype=dtype))
            lengths = np.frombuffer(out.get_bytes(f"{WORK}tokens/{f:06d}.lengths"), dtype="<u4").astype(np.int64)
            at = base + np.concatenate([[0], np.cumsum(lengths)[:-1]])[lengths > 0]  # an empty document starts nothing
            starts.append(at[(at >= lo) & (at < hi)] - lo)
        shard = np.concatenate(parts).astype(write.token_dtype(p["settings"]["vocab_size"]))
        first = np.concatenate(starts).astype(np.int64)
        out.put_bytes(f"{DOCS_PREFIX}{k:05d}{DOCS_SUFFIX}", write._npy(first))
        name = f"{TOKENS_PREFIX}{k:05d}.npy"
        out.put_bytes(name, write._npy(shard))
        out.put_bytes(f"{WORK}shards/{k:05d}.json", json.dumps(
            {"name": name, "tokens": int(len(shard)), "document_starts": int(len(first))}).encode())
        tokens += len(shard)
    return {"tokens": tokens}


def _manifest(out: ObjectStore, p: dict, _: int, endpoint) -> dict:
    s = p["settings"]
    scans = [json.loads(out.get_bytes(f"{WORK}scan/{f:06d}.json")) for f in range(len(p["files"]))]
    toks = _file_tokens(out, p)
    removed = Counter()
    for d in scans + toks:
        removed.update(d["removed"])
    shards = [json.loads(out.get_bytes(o.key)) for o in out.list(f"{WORK}shards/")]
    manifest = {
        "tokenizer": s["tokenizer"], "vocab_size": s["vocab_size"], "dtype": str(write.token_dtype(s["vocab_size"])),
        "eos": s["eos"], "text_field": s["text_field"], "min_chars": s["min_chars"], "dedup": s["dedup"],
        "inputs": s["inputs"], **({"minhash_threshold": s["minhash_threshold"]} if s["dedup"] == "minhash" else {}),
        **({"quality": s["quality"]} if "quality" in s else {}), "partitions": s["partitions"],
        "documents_in": sum(d["documents_in"] for d in scans), "documents_out": sum(d["documents"] for d in toks),
        "tokens": sum(d["tokens"] for d in toks), "removed": dict(sorted(removed.items())), "shards": shards,
    }
    out.put_bytes(write.MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return {"documents": manifest["documents_out"], "tokens": manifest["tokens"]}


def main(argv: list[str] | None = None) -> int:
    """A pod's entry: `python -m kiln.trainer.data.stages STAGE OUTPUT`, its index from JOB_COMPLETION_INDEX."""
    parser = argparse.ArgumentParser(prog="kiln-data-stage")
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("output")
    parser.add_argument("--endpoint", default=os.environ.get("KILN_S3_ENDPOINT"))
    args = parser.parse_args(argv)
    try:
        run_index(args.output, args.stage, int(os.environ.get("JOB_COMPLETION_INDEX", "0")), args.endpoint)
    except KilnError as err:
        print(f"kiln: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
