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

        if rank == 1:  # this rank's first shard upload fails for good (e.g. retries exhausted)
            real, calls = ckpt_mod.StoreFS._publish, []

            def flaky(self, *args):
                calls.append(1)
                if len(calls) == 1:
                    raise OSError("injected: upload failed after retries")
                return real(self, *args)

            ckpt_mod.StoreFS._publish = flaky
        torch.manual_seed(0)
        model = nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ck = ckpt_mod.Checkpointer(CheckpointSpec(uri=f"file://{root}"), default_uri="", rank=rank, world_size=world)
        ck.save(1, [model], [opt], {"step": 1})  # async: fails in the background on every rank
        ck.save(2, [model], [opt], {"step": 2})  # waits for the failed one, then commits
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
    mp.start_processes(_worker, args=(2, _free_port(), str(root), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "error" not in r, r.get("error")
        assert r == {"failures": 1, "committed": 2}
    assert not (root / "step-00000001" / "COMMIT").exists()
    assert (root / "step-00000002" / "COMMIT").exists()
