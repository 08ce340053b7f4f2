"""Mixture-of-experts feed-forward: a token-choice top-k router over SwiGLU experts held as stacked weights.

    x (B, S, dim) -> router logits (T, E) -> scores (softmax or sigmoid) -> top-k experts per token
      -> dispatch: the T*k (token, expert) rows sorted by expert (a stable argsort: expert 0's rows first)
      -> GroupedExperts(rows, tokens_per_expert): one grouped GEMM per weight (`torch._grouped_mm`), or a loop
      -> combine: rows put back in (token, slot) order, weighted by their scores and summed over the k slots
      (+ Qwen2-MoE's shared expert, scaled by a sigmoid gate)

No token is dropped: there is no capacity, every expert takes every row routed to it (the grouped GEMM takes
ragged groups). Expert parallelism (kiln.trainer.parallel) wraps `MoE.experts` from outside: it exchanges the
per-expert counts, sends rows to the ranks that hold their experts and back, so this module never knows about
it (the contract between the two is /tmp/kiln-logs/s10/moe-contract.md, summarised in docs/trainer.md).

Each forward leaves its router statistics in `MoE.stats` (the model sums them into the load-balancing loss and
the per-step metrics: kiln.trainer.model.transformer).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kiln.trainer.model import kernels


def grouped_mm_runs(device: torch.device, dtype: torch.dtype, *widths: int) -> bool:
    """Whether `torch._grouped_mm` takes this device and these shapes: the CPU (any float dtype), CUDA from
    compute capability 9.0 (its kernel's floor); rows whose byte stride is not a multiple of 16 are refused by
    the op itself. Elsewhere the experts run as a loop of plain matmuls, which gives the same result."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any((w * torch.empty((), dtype=dtype).element_size()) % 16 for w in widths):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def describe(device: torch.device, dtype: torch.dtype, dim: int, hidden: int) -> str:
    """One line for the start of a run: how the experts' GEMMs run here, and why not grouped when not."""
    if grouped_mm_runs(device, dtype, dim, hidden):
        return f"moe experts: grouped GEMMs (torch._grouped_mm on {device.type.upper()})"
    if not hasattr(torch, "_grouped_mm"):
        why = "this torch has no torch._grouped_mm"
    elif device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        why = "the GPU is below compute capability 9.0"
    elif device.type not in ("cpu", "cuda"):
        why = f"torch._grouped_mm has no {device.type} kernel"
    else:
        why = f"dim {dim} or the expert hidden size {hidden} is not a multiple of 16 bytes in {dtype}"
    return f"moe experts: a loop of matmuls, one per expert, because {why}"


class GroupedExperts(nn.Module):
    """num_experts SwiGLU experts as stacked weights; parameters named w1 (gate), w2 (down), w3 (up).

    w1, w3: (num_experts, hidden, dim); w2: (num_experts, dim, hidden), each expert's slice laid out as a
    `nn.Linear` weight (out, in), so Hugging Face's per-expert tensors are the slices as they are."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.grouped: bool | None = None  # None: decided per call by grouped_mm_runs; tests force either path

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: (T, dim) rows already sorted by expert (expert 0's rows first); tokens_per_expert: (E,) int64
        counts summing to T, E = the number of experts this module holds (self.w1.shape[0]). Returns (T, dim)."""
        w1, w2, w3 = self.weights()
        grouped = self.grouped
        if grouped is None:
            grouped = grouped_mm_runs(x.device, x.dtype, w1.shape[-1], w1.shape[-2])
        if grouped:
            return _grouped(x, tokens_per_expert, w1, w2, w3)
        return _loop(x, tokens_per_expert, w1, w2, w3)


    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) of the experts this rank holds, as the GEMMs take them (LoRA adds its update here:
        kiln.trainer.model.lora.LoRAExperts)."""
        return _local(self.w1), _local(self.w2), _local(self.w3)


def _local(w: torch.Tensor) -> torch.Tensor:
    """The experts this rank holds: a DTensor's local shard (expert parallelism shards dim 0; FSDP's
    parameters are gathered before forward), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


def _grouped(x, counts, w1, w2, w3) -> torch.Tensor:
    # offs: the end row of each expert's group (int32, as the op wants); an empty group is a repeated offset
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = kernels.swiglu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs),
                       torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs))
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


def _loop(x, counts, w1, w2, w3) -> torch.Tensor:
    out = []
    for e, rows in enumerate(x.split(counts.tolist())):
        out.append(F.linear(kernels.swiglu(F.linear(rows, w1[e]), F.linear(rows, w3[e])), w2[e]))
    return torch.cat(out) if out else x.new_empty(0, w2.shape[1])


@dataclass
class RouterStats:
    """What one MoE layer's forward leaves for the loss and the metrics.

    tokens: (E,) rows routed to each expert (no gradient); prob_sum: (E,) the softmax probabilities summed over
    the tokens (with gradient: the load-balancing loss flows through it); z_sum: the sum over tokens of
    logsumexp(logits)^2 (with gradient); rows: the tokens routed."""

    tokens: torch.Tensor
    prob_sum: torch.Tensor
    z_sum: torch.Tensor
    rows: int


class Router(nn.Module):
    """Token-choice top-k: scores from `gate` (softmax over all experts, or a sigmoid per expert), the k best
    experts per token, their scores renormalised to sum to 1 when `norm_topk` (Mixtral always; Qwen-MoE's
    norm_topk_prob)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, score: str = "softmax", norm_topk: bool = True):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k, self.score, self.norm_topk = top_k, score, norm_topk

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, dim) -> (logits (T, E), weights (T, k) fp32, experts (T, k) int64)."""
        logits = self.gate(x)
        scores = logits.float().softmax(-1) if self.score == "softmax" else logits.float().sigmoid()
        weights, experts = scores.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, experts


class MoE(nn.Module):
    """The MoE feed-forward: `router` (its Linear `router.gate`), `experts: GroupedExperts`, optional
    `shared_experts` (a dense SwiGLU every token takes) and `shared_gate` (Qwen2-MoE: sigmoid(gate(x)) scales it)."""

    def __init__(self, dim: int, num_experts: int, hidden: int, top_k: int, *, score: str = "softmax",
                 norm_topk: bool = True, shared_hidden: int = 0, shared_gate: bool = False):
        super().__init__()
        from kiln.trainer.model.transformer import FeedForward  # the dense block's MLP, one definition

        self.num_experts = num_experts
        self.router = Router(dim, num_experts, top_k, score, norm_topk)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared_experts = FeedForward(dim, shared_hidden) if shared_hidden else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared_hidden and shared_gate else None
        self.stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        logits, weights, experts = self.router(flat)
        out = combine(self.experts, flat, weights, experts, self.num_experts)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        with torch.no_grad():
            tokens = torch.bincount(experts.flatten(), minlength=self.num_experts)
        self.stats = RouterStats(tokens, logits.float().softmax(-1).sum(0),
                                 torch.logsumexp(logits.float(), -1).square().sum(), flat.shape[0])
        return out.view(bsz, seq, dim)


def combine(experts: nn.Module, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
            num_experts: int) -> torch.Tensor:
    """Dispatch each token's k rows to their experts and combine the results: sum_j weights[t, j] *
    expert_{chosen[t, j]}(flat[t]). `experts(rows, counts)` takes the rows sorted by expert."""
    k = chosen.shape[1]
    order = chosen.flatten().argsort(stable=True)  # (T*k,) slot index of each sorted row
    counts = torch.bincount(chosen.flatten(), minlength=num_experts)
    rows = experts(flat[order // k], counts)
    unsorted = torch.empty_like(rows).index_copy_(0, order, rows)  # back to (token, slot) order
    mixed = (unsorted.view(-1, k, rows.shape[-1]).float() * weights.unsqueeze(-1)).sum(1)
    return mixed.to(flat.dtype)


def router_totals(stats: list[RouterStats], before: torch.Tensor | None = None) -> torch.Tensor:
    """One forward's router statistics summed over its MoE layers, as one float64 vector: the softmax
    probabilities summed per expert (E, with gradient), the z-loss sum (1, with gradient), the rows routed to
    each expert (E) and the rows (1), all over every layer; `before`: the totals of the layers before these (a
    pipeline stage adds its layers to what the previous stage sent: Transformer.stage_forward). float64 holds
    the counts exactly (up to 2^53)."""
    mine = [torch.cat([s.prob_sum.double(), s.z_sum.double().reshape(1), s.tokens.double(),
                       torch.tensor([float(s.rows)], dtype=torch.float64, device=s.tokens.device)]) for s in stats]
    total = torch.stack(mine).sum(0) if mine else None
    if before is None:
        return total
    return before.clone() if total is None else before + total  # a new tensor: a stage's output is not its input


def no_totals(num_experts: int, device: torch.device) -> torch.Tensor:
    """The `router_totals` of no MoE layer yet (a pipeline's first stage of dense layers only)."""
    return torch.zeros(2 * num_experts + 2, dtype=torch.float64, device=device)


def router_losses(totals: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) of one forward, from its `router_totals` over every MoE layer.

    The load-balancing loss as transformers' `load_balancing_loss_func` computes it for Mixtral and Qwen-MoE
    (Switch Transformer's): the fraction of routed rows each expert got and its mean router probability, both
    over the rows of every layer together, then num_experts * sum_e fraction_e * probability_e. It is not a sum
    of per-layer terms, which is why a pipeline carries the totals to the last stage instead of adding a loss
    per stage. The z-loss (ST-MoE): the mean over tokens and layers of logsumexp(router logits)^2."""
    e = num_experts
    rows = totals[2 * e + 1]
    probs, z, tokens = totals[:e] / rows, totals[e] / rows, totals[e + 1:2 * e + 1] / rows
    return (e * (tokens * probs).sum()).float(), z.float()


class RouterLoad:
    """Routed rows per expert and layer, and the router losses, summed over the forwards since the last `read`
    (a step's microbatches): the per-step metrics. Read from the Transformer's forward, never from a block's, so
    activation checkpointing's recomputed forwards are not counted twice. Rows are the model's MoE layers in
    order (`layers` of them), so pipeline stages, each holding some, sum into one table."""

    def __init__(self, layers: int, experts: int):
        self.layers, self.experts = layers, experts
        self.reset()

    def reset(self) -> None:
        self.tokens: torch.Tensor | None = None  # (MoE layers, experts); None until a forward adds to it
        self.aux, self.z, self.forwards = 0.0, 0.0, 0

    # Bookkeeping, never compiled: under torch.compile a counter on this object is a constant that every
    # forward would change, recompiling the model each microbatch until dynamo's recompile limit.
    @torch.compiler.disable
    def add(self, stats: list[RouterStats], rows: list[int]) -> None:
        """A forward's `stats`, those of the MoE layers numbered `rows` (0 the model's first MoE layer)."""
        t = torch.stack([s.tokens for s in stats]).detach()
        full = t.new_zeros(self.layers, self.experts)
        full[rows] = t
        self.tokens = full if self.tokens is None else self.tokens + full  # no in-place update: compile traces it

    @contextlib.contextmanager
    def unchanged(self):
        """Forwards inside leave the load as it was (a pipeline's probe forward, which learns the shapes
        between stages: kiln.trainer.parallel.parallelize.build_pipeline_schedule)."""
        saved = self.tokens, self.aux, self.z, self.forwards
        try:
            yield
        finally:
            self.tokens, self.aux, self.z, self.forwards = saved

    @torch.compiler.disable
    def losses(self, aux: torch.Tensor, z: torch.Tensor) -> None:
        self.aux += aux.detach()
        self.z += z.detach()
        self.forwards += 1

    @staticmethod
    def merged(loads: list["RouterLoad"]) -> "RouterLoad":
        """One RouterLoad of a rank's model parts' (pipeline stages: each holds some layers; the last adds the
        losses), the parts reset."""
        out = RouterLoad(loads[0].layers, loads[0].experts)
        seen = [load.tokens for load in loads if load.tokens is not None]
        out.tokens = torch.stack(seen).sum(0) if seen else None
        out.aux, out.z = sum(load.aux for load in loads), sum(load.z for load in loads)
        out.forwards = sum(load.forwards for load in loads)
        for load in loads:
            load.reset()
        return out

    def sum_over(self, group, device: torch.device) -> None:
        """Sum the loads, the losses and the forwards over `group` (the data-parallel ranks: each routed its own
        share of the batch; or the pipeline stages: each routed it through its own layers, the last added the
        losses; tensor-parallel ranks hold the same tokens and must not be in it), in one all-reduce that every
        rank of the group joins, one whose layers saw no forward too: read() then describes the whole step. The
        loads are counted where the tokens were routed, before any expert-parallel dispatch, so each token
        counts once. float64 holds the counts exactly (up to 2^53)."""
        tokens = self.tokens if self.tokens is not None else torch.zeros(self.layers, self.experts, device=device)
        flat = torch.cat([tokens.flatten().double(),
                          torch.tensor([float(self.aux), float(self.z), float(self.forwards)], dtype=torch.float64,
                                       device=tokens.device)])
        dist.all_reduce(flat, group=group)
        n = tokens.numel()
        self.tokens = flat[:n].view(tokens.shape).round().long()
        self.aux, self.z, self.forwards = float(flat[n]), float(flat[n + 1]), int(flat[n + 2])

    def read(self) -> dict[str, float] | None:
        """The metrics of the forwards since the last read (None when there were none), then reset: balance (the
        largest max/mean expert load of any layer), the coefficient of variation of the loads (mean over layers),
        the busiest and idlest expert's rows (over layers), and the unweighted aux and z losses per forward."""
        if self.tokens is None:
            return None
        t = self.tokens.double()
        mean = t.mean(1).clamp(min=1e-9)
        out = {"moe_balance": float((t.max(1).values / mean).max()),
               "moe_load_cv": float((t.std(1, correction=0) / mean).mean()),
               "moe_busiest_tokens": int(t.max()), "moe_idlest_tokens": int(t.min())}
        if self.forwards:
            out.update(moe_aux_loss=float(self.aux) / self.forwards, moe_z_loss=float(self.z) / self.forwards)
        self.reset()
        return out
