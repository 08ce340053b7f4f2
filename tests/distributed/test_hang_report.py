"""A run whose rank hangs leaves every rank's stacks in its store and names the rank the others wait for
(kiln.trainer.observe.hang_report), on real torchrun ranks over gloo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.ft_helpers import die_with_parent
from tests.support.ranks import wait_until
from tests.support.runs import env, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ENTRY = Path(__file__).with_name("hang_entry.py")


def test_a_rank_that_hangs_is_named_and_every_ranks_stacks_are_in_the_store(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 40}, nproc=2,
                      checkpoint={"uri": f"file://{ckpt}/", "intervalSteps": 1000})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(ENTRY),
           "--config", str(spec), "--output", str(out)]
    # The rule gives no verdict before 5 step times; rank 1 hangs in step 12, and 3 s without progress (the
    # floor) is a hang at this model's millisecond steps.
    log = (tmp_path / "log").open("w")
    # the ranks run in sessions of their own (torchrun's), which killpg does not reach: they die with torchrun
    proc = subprocess.Popen(cmd, env=env(KILN_TEST_HANG_AT="12", KILN_TEST_HANG_RANK="1",
                                         KILN_HANG_FLOOR_SECONDS="3", **die_with_parent()),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        line = wait_until("rank 0's hang line", lambda: next(
            (ln for ln in (tmp_path / "log").read_text().splitlines() if ln.startswith("kiln: hang:")), None),
            alive=lambda: proc.poll() is None, context=lambda: (tmp_path / "log").read_text()[-3000:])
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    folders = list((ckpt / "incidents" / "hang").iterdir())
    assert len(folders) == 1
    dumps = {p.name: p.read_text() for p in folders[0].iterdir() if p.is_file()}
    assert set(dumps) == {"rank-0.txt", "rank-1.txt"}
    assert "hang_entry.py" in dumps["rank-1.txt"]  # the hung rank's stack shows where it hangs
    assert "torch/distributed/" in dumps["rank-0.txt"]  # the other waits in a collective
    assert "rank(s) [1] are not in a collective while the others wait in one" in line
    assert "the stacks of 2/2 ranks" in line
    # each rank's flight recorder (gloo's here), read by torch's own fr_trace loader: rank 0 entered a collective
    # of some process group that rank 1, hung outside any, never reached
    from torch.distributed.flight_recorder.components.loader import read_dump

    records = {r: read_dump("rank-", str(folders[0] / "flight-recorder" / f"rank-{r}")) for r in (0, 1)}
    assert all(records[r]["rank"] == r and records[r]["entries"] for r in (0, 1))

    def last_seq(dump: dict) -> dict:
        seqs: dict = {}
        for e in dump["entries"]:
            if not e["is_p2p"]:
                seqs[e["process_group"]] = max(seqs.get(e["process_group"], 0), e["collective_seq_id"])
        return seqs

    ahead = last_seq(records[0])
    behind = last_seq(records[1])
    assert any(seq > behind.get(group, 0) for group, seq in ahead.items()), (ahead, behind)
