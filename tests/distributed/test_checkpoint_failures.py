"""A save that fails on one rank fails on every rank, without a hang, and the next save commits (real gloo)."""

from __future__ import annotations

import json
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = [pytest.mark.distributed]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, root, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from kiln.api.spec import CheckpointSpec
        from kiln.trainer import checkpoint as ckpt_mod
        from kiln.trainer import dcp_store

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
        result = {"failures": ck.save_failures, "committed": ck.last_committed_step}
        ck.close()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_failure_on_one_rank_is_seen_by_all_and_the_next_save_commits(tmp_path):
    root = tmp_path / "ckpt"
    mp.start_processes(
        _worker, args=(2, _free_port(), str(root), str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "error" not in r, r.get("error")
        assert r == {"failures": 2, "committed": 3}
    assert not (root / "step-00000001" / "COMMIT").exists()
    assert not (root / "step-00000002" / "COMMIT").exists()
    assert (root / "step-00000003" / "COMMIT").exists()
