"""Expert parallelism: each rank of an EP group holds num_experts / EP experts; tokens travel to them and back.

The model never knows (as for TP and FSDP): `apply_ep` shards each MoE's `experts` (a GroupedExperts, weights
(E, ...) stacked on dim 0) as `Shard(0)` DTensors over the EP mesh and wraps its call. The MoE gives the
experts its rows sorted by global expert with the count per expert; the wrapper
1. exchanges the counts (an all-to-all of E numbers: rank r learns how many rows each rank sends to each
   of its local experts), so every split size is known before any row moves;
2. sends the rows with one all-to-all (autograd-aware: its backward is the reverse all-to-all), then regroups
   them, which arrive by source rank, by local expert;
3. runs the local experts, undoes the regrouping, and sends every row back with the reverse all-to-all, so
   the MoE gets its rows in the order it sent them.

EP is borrowed from FSDP's shard ranks (docs/trainer.md says why): the mesh splits dp_shard into
`efsdp x ep`; the experts are FSDP-sharded over efsdp (and replicated over dp_replicate), everything else over
all of dp_shard as without EP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn


def exchange_counts(counts: Tensor, group) -> Tensor:
    """counts: (E,) rows this rank sends to each global expert. Returns (EP, E / EP): row s holds how many rows
    rank s sends to each of this rank's local experts (this rank owns experts [r E/EP, (r+1) E/EP))."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)


def check_counts(received: Tensor, rows: int) -> None:
    """Every rank routes a microbatch of the same shape, so no source sends more rows than this rank has itself:
    counts off the network that say otherwise would make this rank allocate what a peer dictates."""
    per_source = received.sum(1)
    if (received < 0).any() or (per_source > rows).any():
        from kiln.errors import KilnError

        raise KilnError(f"expert parallelism: the ranks of the EP group announced {per_source.tolist()} rows for "
                        f"this rank's experts, each at most {rows} (a microbatch's routed rows); refusing them")


def _all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group))


def dispatch(x: Tensor, counts: Tensor, group) -> tuple[Tensor, Tensor, tuple]:
    """Send rows x (T, dim), sorted by global expert with `counts` (E,) per expert, to the ranks owning their
    experts. Returns (rows for this rank's experts sorted by local expert, their counts (E/EP,), the plan
    `combine` needs to send the results back)."""
    ep = dist.get_world_size(group)
    received = exchange_counts(counts, group)  # (EP sources, local experts)
    check_counts(received, x.shape[0])
    input_splits = counts.view(ep, -1).sum(1).tolist()
    output_splits = received.sum(1).tolist()
    routed = _all_to_all(x, output_splits, input_splits, group)
    # Rows arrive by source rank, within it by local expert: a stable sort by local expert regroups them.
    n_local = received.shape[1]
    expert_of_row = torch.arange(n_local, device=counts.device).repeat(ep).repeat_interleave(received.flatten())
    order = torch.argsort(expert_of_row, stable=True)
    return routed[order], received.sum(0), (order, input_splits, output_splits)


def combine(y: Tensor, plan: tuple, group) -> Tensor:
    """The experts' outputs y (rows as `dispatch` returned them) back to their ranks, in the order sent."""
    order, input_splits, output_splits = plan
    by_source = y[torch.argsort(order)]  # undo the regrouping: rows by source rank again
    return _all_to_all(by_source, input_splits, output_splits, group)


class _ExpertParallelForward:
    """Replaces GroupedExperts.forward: dispatch, the module's own forward on its local experts, combine."""

    def __init__(self, forward, group):
        self.forward, self.group = forward, group

    def __call__(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        rows, local_counts, plan = dispatch(x, tokens_per_expert, self.group)
        return combine(self.forward(rows, local_counts), plan, self.group)


def moe_modules(model: nn.Module) -> list[nn.Module]:
    """The MoE layers of the model (kiln.trainer.model.moe.MoE), each with its `experts`."""
    from kiln.trainer.model.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_ep(model: nn.Module, ep_mesh) -> None:
    """Shard every MoE's experts over `ep_mesh` (Shard(0) of the stacked weights) and route their calls."""
    from torch.distributed.tensor import Shard, distribute_tensor

    group = ep_mesh.get_group()
    for moe in moe_modules(model):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            shard = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)  # init_weights fills it
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        experts.forward = _ExpertParallelForward(experts.forward, group)


def shard_experts(model: nn.Module, mesh, layout, mp_policy, reshard: bool) -> None:
    """FSDP2 for the experts over the data-parallel ranks that hold the same experts (efsdp, and dp_replicate
    as HSDP), before the blocks are sharded over all of dp_shard (fully_shard skips what is sharded already).

    An expert's gradient already sums the contributions of every rank of its EP group (the all-to-all's
    backward brings them); FSDP's reduction over efsdp x dp_replicate completes the sum over all data-parallel
    ranks, so it divides by the whole data-parallel size, as the mean over ranks is for every other weight.
    Over more than one efsdp rank the reduction is a plain sum divided after (gloo has no pre-multiplied sum);
    over one, FSDP divides its copy by the factor itself, and a forced sum would divide a second time."""
    from torch.distributed.fsdp import fully_shard

    efsdp = mesh["dp_replicate", "efsdp"] if layout.dp_replicate > 1 else mesh["efsdp"]
    for moe in moe_modules(model):
        fully_shard(moe.experts, mesh=efsdp, mp_policy=mp_policy, reshard_after_forward=reshard)
        moe.experts.set_gradient_divide_factor(float(layout.dp))
        moe.experts.set_force_sum_reduction_for_comms(mesh["efsdp"].size() > 1)
