"""A corpus with planted duplicates and the ways to run `kiln data prepare`'s stages on it (every index in its own
process as the Indexed Jobs do, or all here), shared by the stage, job, quality and S3 tests."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
from pathlib import Path

import pytest

from kiln.storage import open_store
from kiln.trainer.data import stages
from tests.hf_models import save_eos_tokenizer

WORDS = [f"w{i}" for i in range(400)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return save_eos_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def text(rng: random.Random, words: int = 100) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def near(doc: str) -> str:
    """The last of 100 words changed: Jaccard of the 5-gram shingles 95/97, far enough above the 0.8 threshold that
    the LSH bands find the pair all but surely (P(missed) < 1e-6 at these bands)."""
    words = doc.split()
    words[-1] = "changed"
    return " ".join(words)


def planted_corpus(folder: Path, per_file: int = 6, seed: int = 0) -> dict:
    """Four .jsonl files; with 3 workers file f is read by worker f % 3. Planted: an exact copy of a file-0 document
    in file 2 (another worker) and in file 0 itself, whitespace-only variants, and near copies of a file-1
    document in file 3 and of a file-2 document in file 0."""
    rng = random.Random(seed)
    files = [[text(rng) for _ in range(per_file)] for _ in range(4)]
    files[2].insert(1, files[0][2])
    files[0].append("  " + files[0][4] + "\r\n")
    files[3].insert(0, near(files[1][3]))
    files[0].insert(3, near(files[2][0]))
    folder.mkdir()
    for f, docs in enumerate(files):
        (folder / f"part-{f}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return {"duplicate": 2, "near_duplicate": 2}


def run_workers(output: str, workers: int, endpoint: str | None = None) -> None:
    """Every index of every stage in its own process with its JOB_COMPLETION_INDEX, `workers` at a time, as the
    Indexed Jobs run them (forked: no interpreter start per index)."""
    fork = multiprocessing.get_context("fork")
    plan = json.loads(open_store(output, endpoint=endpoint).get_bytes(stages.PLAN))
    for stage in stages.STAGES:
        indexes = list(range(stages.count(plan, stage)))
        for at in range(0, len(indexes), workers):
            procs = [fork.Process(target=_pod, args=(output, stage, i, endpoint)) for i in indexes[at:at + workers]]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
                assert p.exitcode == 0, f"{stage} index failed"


def _pod(output: str, stage: str, index: int, endpoint: str | None) -> None:
    os.environ["JOB_COMPLETION_INDEX"] = str(index)
    raise SystemExit(stages.main([stage, output, *(["--endpoint", endpoint] if endpoint else [])]))


def run_here(output: str, workers: int = 1) -> None:
    plan = json.loads(Path(output.removeprefix("file://"), stages.PLAN).read_text())
    for stage in stages.STAGES:
        for i in range(stages.count(plan, stage)):
            stages.run_index(output, stage, i)


def outputs(folder: Path) -> dict[str, bytes]:
    """The result a trainer reads: every file but the stages' work/ folder."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def settings(tokenizer_file, dedup):
    return dict(tokenizer_uri=f"file://{tokenizer_file}", dedup=dedup, eos="<eos>", shard_tokens=50, min_chars=2)
