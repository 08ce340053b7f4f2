"""A save that fails on one rank fails on every rank, without a hang, and the next save commits (real gloo)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.distributed]


def _worker(rank, world, root):
    from kiln.api.spec import CheckpointSpec
    from kiln.trainer.checkpoint import checkpointer as ckpt_mod
    from kiln.trainer.checkpoint import dcp_store

    if rank == 1:
        # One of this rank's two shard files fails for good (e.g. retries exhausted): at step 1 the first,
        # at step 2 the second. DCP writes them from two threads, so one of the two failures happens in
        # its extra writer thread, whose exceptions DCP itself would drop.
        real = dcp_store.StoreFS._publish
        doomed = {"step-00000001/__1_0.distcp", "step-00000002/__1_1.distcp"}

        def flaky(self, key, *args):
            if key in doomed:
                raise OSError(f"injected: upload of {key} failed after retries")
            return real(self, key, *args)

        dcp_store.StoreFS._publish = flaky
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = ckpt_mod.Checkpointer(CheckpointSpec(uri=f"file://{root}"), default_uri="", rank=rank, world_size=world)
    for step in (1, 2, 3):  # async: 1 and 2 fail in the background on every rank, 3 commits
        ck.save(step, [model], [opt], {"step": step})
    ck.wait()
    result = {"failures": ck.stats.save_failures, "committed": ck.stats.last_committed_step}
    ck.close()
    return result


def test_failure_on_one_rank_is_seen_by_all_and_the_next_save_commits(tmp_path):
    root = tmp_path / "ckpt"
    results = run_ranks(_worker, 2, tmp_path / "ranks", str(root))
    assert results == [{"failures": 2, "committed": 3}] * 2
    assert not (root / "step-00000001" / "COMMIT").exists()
    assert not (root / "step-00000002" / "COMMIT").exists()
    assert (root / "step-00000003" / "COMMIT").exists()
