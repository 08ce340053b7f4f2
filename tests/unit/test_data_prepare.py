"""`kiln data prepare`: every filter counted, exact dedup, the shards hold exactly the tokenizer's ids of the kept
documents (checked against the `tokenizers` library's own encoding), the trainer's data source reads them, and a
complete output is left alone."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from kiln.cli.main import main
from kiln.errors import KilnError
from kiln.trainer.data.loader import open_source
from kiln.trainer.data.prepare import normalise, prepare, token_dtype
from tests.hf_models import save_eos_tokenizer


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return save_eos_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def corpus(folder):
    folder.mkdir()
    (folder / "a.txt").write_text("First document.\r\nWith two lines.  ")
    (folder / "b.jsonl").write_bytes(b"\n".join([
        json.dumps({"text": "Second document."}).encode(),
        json.dumps({"text": "  Second document.  "}).encode(),   # a duplicate once normalised
        b"{not json",                                              # invalid_json
        b"[" * 200_000,                                            # invalid_json: past the parser's recursion limit
        json.dumps({"body": "no text field"}).encode(),           # missing_field
        b'{"text": "bad \xff byte"}',                              # undecodable
        json.dumps({"text": "x"}).encode(),                        # too_short with --min-chars 2
        json.dumps({"text": "Third, cafe\u0301."}).encode(),       # NFC: e + combining accent -> one character
        b"",
    ]))
    (folder / "ignored.csv").write_text("not an input suffix")
    return folder


def test_prepare_counts_filters_dedups_and_writes_the_tokenizers_ids(tmp_path, tokenizer_file, capsys):
    from tokenizers import Tokenizer

    src = corpus(tmp_path / "src")
    out = tmp_path / "out"
    assert main(["data", "prepare", "--input", str(src), "--tokenizer", f"file://{tokenizer_file}",
                 "--output", f"file://{out}", "--min-chars", "2", "--eos", "<eos>", "--shard-tokens", "7"]) == 0
    assert "3 of 9 documents" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["removed"] == {"duplicate": 1, "invalid_json": 2, "missing_field": 1, "too_short": 1,
                                   "undecodable": 1}
    assert (manifest["documents_in"], manifest["documents_out"], manifest["dtype"]) == (9, 3, "uint16")
    tok = Tokenizer.from_file(str(tokenizer_file))
    kept = ["First document.\nWith two lines.", "Second document.", "Third, caf\u00e9."]
    want = [i for text in kept for i in tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<eos>")]]
    shards = [np.load(out / s["name"]) for s in manifest["shards"]]
    assert all(len(s) == 7 for s in shards[:-1]) and 0 < len(shards[-1]) <= 7
    assert np.concatenate(shards).tolist() == want and manifest["tokens"] == len(want)
    # the trainer's data source reads the folder as it is
    samples = open_source(f"file://{out}", seq_len=4, vocab_size=manifest["vocab_size"], seed=0)
    assert samples.get(0).tolist() == want[:5]

    # complete: a rerun changes nothing and says so
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["data", "prepare", "--input", str(src), "--tokenizer", f"file://{tokenizer_file}",
                 "--output", f"file://{out}"]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_bad_arguments_are_one_line_errors(tmp_path, tokenizer_file, capsys):
    src = corpus(tmp_path / "src")
    cases = [
        (["--input", str(tmp_path / "empty")], "no .txt, .jsonl or .parquet files there"),
        (["--input", str(src), "--eos", "<nope>"], "--eos '<nope>' is not a token"),
        (["--input", str(src), "--tokenizer", "byte"], "data prepare needs a tokenizer.json"),
    ]
    (tmp_path / "empty").mkdir()
    for extra, message in cases:
        args = ["data", "prepare", "--tokenizer", f"file://{tokenizer_file}", "--output", f"file://{tmp_path / 'o'}"]
        assert main(args + extra) == 1, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_normalise_and_token_dtype():
    assert normalise(" a\r\ne\u0301 ") == "a\n\u00e9"
    assert token_dtype(65536) == np.uint16 and token_dtype(128256) == np.uint32
    with pytest.raises(KilnError, match="needs a tokenizer.json"):
        prepare(["/nonexistent/x.jsonl"], tokenizer_uri="byte", output="file:///tmp/kiln-never")


def test_an_interrupted_run_resumes_after_its_finished_shards(tmp_path, tokenizer_file, monkeypatch):
    import kiln.trainer.model.hf_folder as hf
    from kiln.trainer.data import prepare as prep

    src = tmp_path / "src"
    src.mkdir()
    lines = [json.dumps({"text": f"Document number {i} says {'more ' * (i % 5)}things."}) for i in range(40)]
    (src / "docs.jsonl").write_text("\n".join(lines + lines[:5]))  # 5 duplicates at the end
    real_load = hf.load_tokenizer
    tokenized: list[int] = []

    class Counting:  # the real tokenizer, counting the documents it encodes
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def encode_batch(self, batch, **kw):
            tokenized.append(len(batch))
            return self.tok.encode_batch(batch, **kw)

        def encode_batch_fast(self, batch, **kw):
            tokenized.append(len(batch))
            return self.tok.encode_batch_fast(batch, **kw)

    monkeypatch.setattr(hf, "load_tokenizer", lambda *a: Counting(real_load(*a)))
    kwargs = dict(tokenizer_uri=f"file://{tokenizer_file}", eos="<eos>", shard_tokens=50, batch_docs=4, log=lambda m: None)
    whole = prepare([str(src)], output=f"file://{tmp_path / 'whole'}", **kwargs)
    assert sum(tokenized) == 40 and len(whole.shards) > 4

    writes = {"n": 0}
    real_write = prep.ShardWriter._write

    def crash_after_three(self, *args):
        if writes["n"] == 3:
            raise RuntimeError("killed")
        writes["n"] += 1
        real_write(self, *args)

    monkeypatch.setattr(prep.ShardWriter, "_write", crash_after_three)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="killed"):
        prepare([str(src)], output=f"file://{out}", **kwargs)
    assert not (out / "manifest.json").exists() and (out / "progress.json").exists()
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("tokens-*.npy")}
    assert len(finished) == 3
    monkeypatch.setattr(prep.ShardWriter, "_write", real_write)
    tokenized.clear()
    messages: list[str] = []
    resumed = prepare([str(src)], output=f"file://{out}", **{**kwargs, "log": messages.append})
    assert "resuming" in messages[0] and "after 3 finished shard(s)" in messages[0]
    assert 0 < sum(tokenized) < 40  # the documents of the finished shards were not tokenized again
    assert {p: out.joinpath(p).stat().st_mtime_ns for p in finished} == finished
    assert not (out / "progress.json").exists()
    for key in ("documents_in", "documents_out", "tokens"):
        assert getattr(resumed, key) == getattr(whole, key), key
    assert resumed.removed == whole.removed == {"duplicate": 5}
    for a, b in zip(whole.shards, resumed.shards, strict=True):
        assert np.array_equal(np.load(tmp_path / "whole" / a["name"]), np.load(out / b["name"]))
        docs = a["name"].replace("tokens-", "docs-").replace(".npy", ".idx")  # document starts carried over too
        assert np.array_equal(np.load(tmp_path / "whole" / docs), np.load(out / docs))
    # another run's settings are not mixed into an interrupted folder
    (out / "manifest.json").unlink()
    (out / "progress.json").write_text(json.dumps({"settings": {}, "shards": [], "kept_documents": 0, "carry": []}))
    with pytest.raises(KilnError, match="holds an interrupted run with other inputs or settings"):
        prepare([str(src)], output=f"file://{out}", **kwargs)


def test_minhash_drops_near_duplicates_that_exact_dedup_keeps(tmp_path, tokenizer_file):
    from kiln.trainer.data.loader import pydoc_bytes

    long = (p.strip() for p in pydoc_bytes().decode().split("\n\n") if len(p.split()) > 60)
    paragraphs = list(dict.fromkeys(long))[:30]  # 30 distinct paragraphs of over 60 words
    src = tmp_path / "src"
    src.mkdir()
    near = [p + " Amen." for p in paragraphs[:10]]  # one word more: near, not exact
    (src / "d.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in paragraphs + near))
    common = dict(tokenizer_uri=f"file://{tokenizer_file}", log=lambda m: None)
    exact = prepare([str(src)], output=f"file://{tmp_path / 'exact'}", dedup="exact", **common)
    assert exact.documents_out == 40 and exact.removed == {}
    minhash = prepare([str(src)], output=f"file://{tmp_path / 'minhash'}", dedup="minhash", **common)
    assert minhash.documents_out == 30 and minhash.removed == {"near_duplicate": 10}
    manifest = json.loads((tmp_path / "minhash" / "manifest.json").read_text())
    assert manifest["minhash_threshold"] == 0.8 and manifest["removed"] == {"near_duplicate": 10}
    with pytest.raises(KilnError, match="threshold in"):
        prepare([str(src)], output=f"file://{tmp_path / 'bad'}", dedup="minhash", minhash_threshold=0, **common)


def test_parquet_rows_are_documents_and_bad_files_are_counted(tmp_path, tokenizer_file):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"text": ["Row one.", None, "Row two.", "Row one."], "n": [1, 2, 3, 4]}),
                   src / "a.parquet")
    pq.write_table(pa.table({"body": ["no text column", "here"]}), src / "b.parquet")
    (src / "c.parquet").write_bytes(b"PAR1 this is not parquet")
    calls = []
    res = prepare([str(src)], tokenizer_uri=f"file://{tokenizer_file}", output=f"file://{tmp_path / 'out'}",
                  log=lambda m: None, progress=lambda *a: calls.append(a))
    assert (res.documents_out, res.documents_in) == (2, 6)  # 4 rows + 2 rows without the column
    # (files done, files, documents kept, shards written) after each file and each tokenized batch
    assert calls == [(1, 3, 2, 0), (2, 3, 2, 0), (3, 3, 2, 0), (3, 3, 2, 0)]
    assert res.removed == {"duplicate": 1, "missing_field": 3, "unreadable_file": 1}


def _peak_rss_mib(args: list[str]) -> float:
    """Peak resident memory of `kiln` run with args in a subprocess of its own (its rusage alone, from wait4)."""
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", *args])
    _, status, usage = os.wait4(child.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return usage.ru_maxrss / 1024  # KiB on Linux


def test_memory_stays_bounded_on_inputs_much_larger_than_the_bound(tmp_path, tokenizer_file):
    """Every input file is streamed: a jsonl whose one line is 256 MiB, a 256 MiB .txt, 25 MB of jsonl lines
    and a 25 MB parquet file of small row groups raise kiln's peak memory by less than 64 MiB over the same
    command on a tiny input (whose peak, ~0.7 GB, is its imports'), where reading one long record whole adds
    over 200 MiB to that peak (measured with --max-doc-bytes past it). The long records are skipped and counted;
    the rest are read and deduplicated."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir()
    big.mkdir()
    (small / "a.jsonl").write_text(json.dumps({"text": "A small document."}) + "\n")
    doc = "The same paragraph, over and over. " * 30  # ~1 KB: after the first copy, each is a duplicate
    line = json.dumps({"text": doc}) + "\n"
    with open(big / "a-long-line.jsonl", "w") as f:
        f.write(json.dumps({"text": "A short document before the long line."}) + "\n")
        f.write('{"text": "' + "x" * (256 << 20) + '"}\n')
        f.write(json.dumps({"text": "And one after it."}) + "\n")
    with open(big / "b-lines.jsonl", "w") as f:
        f.writelines([line] * (24 << 10))
    (big / "c-huge.txt").write_bytes(b"y" * (256 << 20))
    pq.write_table(pa.table({"text": [doc] * (24 << 10)}), big / "d.parquet", row_group_size=1024,
                   use_dictionary=False, compression="none")
    assert (big / "d.parquet").stat().st_size > 24e6

    common = ["data", "prepare", "--tokenizer", f"file://{tokenizer_file}", "--max-doc-bytes", str(1 << 20)]
    baseline = _peak_rss_mib(common + ["--input", str(small), "--output", f"file://{tmp_path / 'out-small'}"])
    peak = _peak_rss_mib(common + ["--input", str(big), "--output", f"file://{tmp_path / 'out-big'}"])
    manifest = json.loads((tmp_path / "out-big" / "manifest.json").read_text())
    assert manifest["removed"] == {"too_large": 2, "duplicate": 2 * (24 << 10) - 1}
    assert manifest["documents_out"] == 3 and manifest["documents_in"] == 4 + 2 * (24 << 10)
    assert peak - baseline < 64, (baseline, peak)


def test_progress_bar_reports_documents_and_shards_on_a_terminal_only(tmp_path, tokenizer_file):
    from rich.console import Console

    from kiln.cli.data_cmds import prepare_progress

    src = tmp_path / "src"
    src.mkdir()
    (src / "d.jsonl").write_text("\n".join(json.dumps({"text": f"Document {i} of the progress test."})
                                           for i in range(40)))
    for terminal in (True, False):
        out = io.StringIO()
        console = Console(file=out, force_terminal=terminal, width=200)
        seen: list[tuple] = []
        with prepare_progress(console) as progress:
            def recorded(*state):
                seen.append(state)
                progress(*state)
            prepare([str(src)], tokenizer_uri=f"file://{tokenizer_file}", output=f"file://{tmp_path / str(terminal)}",
                    shard_tokens=60, batch_docs=10, log=lambda m: None, progress=recorded)
        text = out.getvalue()
        # after each of the 4 batches of 10 kept documents and after the file: documents kept, shards written
        docs, shards = [s[2] for s in seen], [s[3] for s in seen]
        assert len(seen) == 5 and docs == sorted(docs) and docs[0] >= 10 and docs[-1] == 40
        assert shards == sorted(shards) and 0 < shards[-1] <= len(list((tmp_path / str(terminal)).glob("tokens-*")))
        if terminal:  # each state drawn as it came
            for done, total, docs, shards in seen:
                assert f"{done}/{total} files {docs:,} documents kept, {shards:,} shards" in _plain(text)
        else:  # not a terminal: nothing of the bar
            assert text.strip() == ""


def _plain(rich_output: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", rich_output)
