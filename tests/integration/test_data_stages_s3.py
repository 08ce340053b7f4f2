"""`kiln data prepare --workers`'s stages against the rig's real S3 server: inputs, tokenizer and output in the
bucket, every index a separate process with its JOB_COMPLETION_INDEX (as the Indexed Jobs' pods), and the result
in the bucket is byte for byte the one-process command's on the same files (streamed run writes, ranged reads of
the token files and the runs)."""

from __future__ import annotations

import json

import pytest

from kiln.storage import open_store
from kiln.trainer.data import prepare as one
from kiln.trainer.data import stages
from tests.support.s3 import s3_prefix  # noqa: F401 - fixture
from tests.support.data_stages import outputs, planted_corpus, run_workers, settings, tokenizer_file  # noqa: F401

pytestmark = [pytest.mark.rig, pytest.mark.slow]


def test_three_workers_over_s3_give_the_one_process_result(rig, s3_prefix, tmp_path, tokenizer_file):  # noqa: F811
    planted_corpus(tmp_path / "src")
    store = open_store(s3_prefix, endpoint=rig.s3_endpoint)
    for f in (tmp_path / "src").iterdir():
        store.put_file(f"src/{f.name}", f)
    store.put_file("tok/tokenizer.json", tokenizer_file)
    common = {**settings(tokenizer_file, "minhash"), "tokenizer_uri": s3_prefix + "tok/tokenizer.json"}
    out = s3_prefix + "out/"
    stages.plan([s3_prefix + "src/"], out, workers=3, partitions=3, endpoint=rig.s3_endpoint, **common)
    run_workers(out, 3, endpoint=rig.s3_endpoint)

    one.prepare([str(tmp_path / "src")], output=f"file://{tmp_path / 'one'}", log=lambda *_: None,
                **settings(tokenizer_file, "minhash"))
    want = outputs(tmp_path / "one")
    got = {o.key.removeprefix("out/"): store.get_bytes(o.key) for o in store.list("out/")
           if not o.key.startswith("out/work/")}
    got_manifest, want_manifest = json.loads(got.pop("manifest.json")), json.loads(want.pop("manifest.json"))
    assert got == want
    for m in (got_manifest, want_manifest):
        m.pop("inputs"), m.pop("tokenizer"), m.pop("partitions", None)
    assert got_manifest == want_manifest and got_manifest["removed"] == {"duplicate": 2, "near_duplicate": 2}
