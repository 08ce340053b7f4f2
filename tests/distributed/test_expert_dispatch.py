"""Expert parallelism's token routing on real gloo ranks (kiln.trainer.parallel.expert): dispatch sends every
row to the rank holding its expert, combine brings every row back to its own rank in its own order; nothing lost,
nothing duplicated, and the backward pass routes the gradients the same way.

The experts here are a tag each row cannot fake: local expert j of rank r multiplies its rows by (global expert
id + 1) and adds the id of the rank that ran it times 1000, so a row that came back from the wrong expert, the
wrong rank, twice or not at all differs from the EP 1 answer computed on the rank itself.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.distributed

EXPERTS = 4
DIM = 3


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-specific rows sorted by expert and the count per expert: rank 1 sends nothing to expert 1 and
    nothing at all to rank 0's second expert, rank 0 sends expert 3 nothing (empty groups and splits)."""
    g = torch.Generator().manual_seed(rank)
    counts = torch.tensor([[3, 0, 2, 0], [1, 0, 4, 2]][rank] if rank < 2 else [2, 2, 2, 2], dtype=torch.int64)
    return torch.randn(int(counts.sum()), DIM, generator=g), counts


def _routing(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from kiln.trainer.parallel.expert import combine, dispatch

    group = dist.group.WORLD
    x, counts = _rows(rank)
    x.requires_grad_(True)
    n_local = EXPERTS // world
    rows, local_counts, plan = dispatch(x, counts, group)
    # What this rank's experts received: every source's rows for them, grouped by local expert.
    got_counts = local_counts.tolist()
    expert_id = rank * n_local + torch.arange(n_local).repeat_interleave(local_counts)
    y = rows * (expert_id + 1).unsqueeze(1).float() + 1000.0 * rank
    out = combine(y, plan, group)
    weights = torch.arange(out.numel(), dtype=torch.float32).view_as(out)
    (out * weights).sum().backward()
    return {"rows": x.detach().tolist(), "counts": counts.tolist(), "received": got_counts,
            "out": out.detach().tolist(), "grad": x.grad.tolist()}


@pytest.mark.parametrize("world", [2, 4], ids=["ep2", "ep4"])
def test_dispatch_and_combine_lose_and_duplicate_no_row(tmp_path, world):
    results = run_ranks(_routing, world, tmp_path)
    n_local = EXPERTS // world
    for rank, r in enumerate(results):
        x, counts = torch.tensor(r["rows"]), torch.tensor(r["counts"])
        # EP 1: the same tags applied on this rank itself, the owner of expert e being rank e // n_local
        expert = torch.arange(EXPERTS).repeat_interleave(counts)
        owner = (expert // n_local).float()
        want = x * (expert + 1).unsqueeze(1).float() + 1000.0 * owner.unsqueeze(1)
        torch.testing.assert_close(torch.tensor(r["out"]), want, rtol=0, atol=1e-5)
        weights = torch.arange(want.numel(), dtype=torch.float32).view_as(want)
        torch.testing.assert_close(torch.tensor(r["grad"]), weights * (expert + 1).unsqueeze(1).float(),
                                   rtol=0, atol=1e-5)
    # Each rank's experts received exactly the rows all ranks sent them, no more and no fewer.
    sent = torch.stack([torch.tensor(r["counts"]) for r in results]).sum(0)
    for rank, r in enumerate(results):
        assert r["received"] == sent[rank * n_local:(rank + 1) * n_local].tolist()


def test_counts_a_peer_cannot_have_sent_are_refused():
    from kiln.errors import KilnError
    from kiln.trainer.parallel.expert import check_counts

    check_counts(torch.tensor([[3, 1], [0, 4]]), rows=4)  # every source sends at most its own 4 rows
    with pytest.raises(KilnError, match=r"announced \[4, 5\] rows .* each at most 4"):
        check_counts(torch.tensor([[3, 1], [0, 5]]), rows=4)
    with pytest.raises(KilnError, match="announced"):
        check_counts(torch.tensor([[-1, 1], [0, 1]]), rows=4)
