"""LoRA adapters (Hu et al. 2021) on kiln's plain decoder, applied by module name (TorchTitan's converter style).

`apply_lora` turns each target `nn.Linear` (spec.model.adapter.targets, by its transformers name: q_proj, ...)
into a `LoRALinear` in place: the same module object with the same `weight` (so its name, its checkpoint key
and any tensor-parallel hooks on it stay), plus two children `lora_A` (rank × in) and `lora_B` (out × rank):

    y = x Wᵀ + (alpha / rank) · B A dropout(x)

exactly peft's `LoraLayer` (its `base_model.model.<path>.lora_A.weight` keys map one to one onto kiln's
`<path>.lora_A.weight`, kiln.trainer.model.peft_folder). Every other parameter is frozen (requires_grad False)
and kept in the run's precision (bf16 under training.precision bf16), the adapters in fp32: the optimizer, the
gradients and the checkpoints (StateDictOptions(ignore_frozen_params)) see the adapters only.

A mixture of experts' routed experts are stacked parameters, not Linears: `LoRAExperts` gives them one adapter per
expert (targets experts.gate_up_proj, experts.down_proj: peft's `target_parameters` on transformers' stacked
experts), folded into the weights each forward.

Applied after tensor parallelism and before FSDP2 (kiln.trainer.parallel.parallelize): an adapter is laid out to
match its base weight's tensor-parallel plan — a column-wise W (out sharded) gets a replicated A and an
out-sharded B, a row-wise W (in sharded) an in-sharded A and a replicated B — so the update is computed where
the base output is, with no extra collective. FSDP2 then shards frozen and trainable parameters of a block in
one unit (it allows mixed requires_grad; only the trainable ones must share a dtype).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from kiln.api.presets import Arch
from kiln.api.spec import EXPERT_TARGETS, LORA_TARGETS, AdapterSpec
from kiln.errors import KilnError
from kiln.trainer.model.hf_folder import hf_name
from kiln.trainer.model.moe import GroupedExperts
from kiln.trainer.model.transformer import _copy_into

ADAPTER_KEYS = ("lora_A", "lora_B")


def is_adapter(name: str) -> bool:
    """Whether a parameter name (kiln's, transformers' or peft's) is an adapter's."""
    return any(f".{key}." in name for key in ADAPTER_KEYS)


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank update; made from one in place by `adapt`."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float

    @classmethod
    def adapt(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float) -> "LoRALinear":
        """Turn `linear` into a LoRALinear (the object is kept: the hooks tensor parallelism put on it stay)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        w = linear.weight
        a_place = b_place = None
        if isinstance(w, DTensor):  # match the base's TP plan: the update lands where the base output is
            placements = tuple(w.placements)
            a_place = tuple(Shard(1) if p == Shard(1) else Replicate() for p in placements)
            b_place = tuple(Shard(0) if p == Shard(0) else Replicate() for p in placements)
        linear.__class__ = cls
        linear.scaling = alpha / rank
        linear.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        linear.lora_A = _adapter(linear.in_features, rank, w, a_place)
        linear.lora_B = _adapter(rank, linear.out_features, w, b_place)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """Fold the update into the weight (W + scaling · B A) and become a plain nn.Linear again."""
        self.weight += (self.lora_B.weight.float() @ self.lora_A.weight.float() * self.scaling).to(self.weight.dtype)
        for key in (*ADAPTER_KEYS, "lora_dropout"):
            delattr(self, key)
        del self.scaling
        self.__class__ = nn.Linear
        return self


class LoRAExperts(GroupedExperts):
    """GroupedExperts with one low-rank update per expert on the targeted stacked weights: peft's LoRA on
    transformers' `mlp.experts.gate_up_proj` / `down_proj` parameters (its ParamWrapper). `gate_up_proj`: A (experts,
    rank, dim) shared by the gate and up projections, B (experts, 2 x hidden, rank), its first half w1's (gate), the
    second w3's (up); `down_proj`: A (experts, rank, hidden), B (experts, dim, rank). The update is folded into the
    weights each forward, W + scaling · B A per expert, as peft does (no dropout: it cannot be factored out of a
    folded weight). Made from a GroupedExperts in place by `adapt`; under expert parallelism the adapters are
    sharded over the experts as the weights are."""

    gate_up_proj: nn.Module | None
    down_proj: nn.Module | None
    scaling: float

    @classmethod
    def adapt(cls, experts: GroupedExperts, targets: set[str], rank: int, alpha: float) -> "LoRAExperts":
        n, hidden, dim = experts.w1.shape
        experts.__class__ = cls
        experts.scaling = alpha / rank
        pairs = {"gate_up_proj": ((n, rank, dim), (n, 2 * hidden, rank)),
                 "down_proj": ((n, rank, hidden), (n, dim, rank))}
        for name, (a, b) in pairs.items():
            adapter = None
            if f"experts.{name}" in targets:
                adapter = nn.Module()
                adapter.lora_A, adapter.lora_B = _stacked(a, experts.w1), _stacked(b, experts.w1)
            experts.register_module(name, adapter)
        return experts

    def delta(self, name: str) -> torch.Tensor | None:
        """scaling · B A of this rank's experts for one target, None when it has no adapter."""
        adapter = getattr(self, name)
        if adapter is None:
            return None
        b, a = (t.weight.to_local() if isinstance(t.weight, DTensor) else t.weight
                for t in (adapter.lora_B, adapter.lora_A))
        return torch.bmm(b, a) * self.scaling

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w1, w2, w3 = super().weights()
        if (gate_up := self.delta("gate_up_proj")) is not None:
            gate_up = gate_up.to(w1.dtype)
            w1, w3 = w1 + gate_up[:, :w1.shape[1]], w3 + gate_up[:, w1.shape[1]:]
        if (down := self.delta("down_proj")) is not None:
            w2 = w2 + down.to(w2.dtype)
        return w1, w2, w3

    @torch.no_grad()
    def merge(self) -> GroupedExperts:
        """Fold the updates into the weights (a plain, single-process model) and become a GroupedExperts again."""
        w1, w2, w3 = self.weights()
        for param, merged in ((self.w1, w1), (self.w2, w2), (self.w3, w3)):
            param.copy_(merged)
        del self.gate_up_proj, self.down_proj, self.scaling
        self.__class__ = GroupedExperts
        return self


def _stacked(shape: tuple[int, ...], like: torch.Tensor) -> nn.Module:
    """A module holding one fp32 `weight` of `shape` (so its name ends in `.lora_A.weight`, as a Linear's), on
    `like`'s device; sharded on dim 0 (the experts) as `like` is when it is a DTensor."""
    holder = nn.Module()
    w = torch.empty(shape, dtype=torch.float32, device=like.device)
    if isinstance(like, DTensor):
        w = distribute_tensor(w, like.device_mesh, like.placements, src_data_rank=None)
    holder.weight = nn.Parameter(w)
    return holder


def _adapter(in_features: int, out_features: int, like: torch.Tensor, placements) -> nn.Linear:
    """An fp32 nn.Linear on `like`'s device; a DTensor on its mesh with `placements` when it is one."""
    layer = nn.Linear(in_features, out_features, bias=False, device=like.device, dtype=torch.float32)
    if placements is not None:
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank None: no communication (the values are set later, by init_adapters or a checkpoint)
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), like.device_mesh, placements,
                                                      src_data_rank=None))
    return layer


def target_of(module_name: str, arch: Arch = Arch()) -> str | None:
    """The transformers name of a kiln module (`layers.3.attention.wq` -> q_proj; a Qwen2-MoE shared expert's
    `layers.0.feed_forward.shared_experts.w1` -> gate_proj, which needs the family), None for one it lacks."""
    try:
        return hf_name(module_name + ".weight", arch).removesuffix(".weight").rsplit(".", 1)[-1]
    except KeyError:
        return None


def arch_of(model: nn.Module) -> Arch:
    """The model's family (kiln's Transformer carries its dims), Llama's for any other module."""
    dims = getattr(model, "dims", None)
    return dims.arch if dims is not None else Arch()


def offered_targets(model: nn.Module, layers: range | None = None) -> set[str]:
    """The targets (spec.model.adapter.targets' names) that `model` has modules for; in blocks `layers` only."""
    arch, offered = arch_of(model), set()
    for name, module in model.named_modules():
        if layers is not None and not (name.startswith("layers.") and int(name.split(".")[1]) in layers):
            continue
        if type(module) is GroupedExperts:
            offered.update(EXPERT_TARGETS)
        elif type(module) is nn.Linear:
            offered.add(target_of(name, arch))
    # the router's `gate` and Qwen2-MoE's `shared_expert_gate` are Linears too, but no target names them
    return offered & set(LORA_TARGETS + EXPERT_TARGETS)


def apply_lora(model: nn.Module, adapter: AdapterSpec, base_dtype: torch.dtype = torch.float32,
               offered: set[str] | None = None) -> nn.Module:
    """Adapters on every target projection, every other parameter frozen and cast to `base_dtype`. KilnError
    naming spec.model.adapter.targets when a target names no module of the model (checked on the meta
    device, before any memory or GPU time is spent). `offered`: the whole model's targets (offered_targets) when
    `model` is one pipeline stage of it, which may lack some (a stage of Qwen2-MoE's dense layers has no experts)."""
    wanted = set(adapter.targets)
    arch = arch_of(model)
    experts = wanted & set(EXPERT_TARGETS)
    if experts and adapter.dropout:
        raise KilnError(f"spec.model.adapter.dropout: got {adapter.dropout} with targets {sorted(experts)}; LoRA on "
                        f"the routed experts folds its update into their weights (peft's too), so it has no dropout: "
                        f"set dropout 0")
    offered = offered_targets(model) if offered is None else offered
    if wanted - offered:
        raise KilnError(f"spec.model.adapter.targets: {sorted(wanted - offered)[0]!r} names no module of this model "
                        f"(its projections: {', '.join(sorted(offered))})")
    for name, module in list(model.named_modules()):
        if type(module) is GroupedExperts and experts:
            LoRAExperts.adapt(module, experts, adapter.rank, adapter.alpha)
        elif type(module) is nn.Linear and target_of(name, arch) in wanted:
            LoRALinear.adapt(module, adapter.rank, adapter.alpha, adapter.dropout)
    adapters = {id(p) for n, p in model.named_parameters() if is_adapter(n)}
    for module in model.modules():  # the rest frozen, in the run's precision (on meta: no memory yet)
        for key, param in list(module._parameters.items()):
            if param is not None and id(param) not in adapters:
                module.register_parameter(key, nn.Parameter(param.detach().to(base_dtype), requires_grad=False))
    return model


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """peft's default initialisation, from (seed, the parameter's name) in every layout alike: A uniform in
    ±1/sqrt(in) (kaiming-uniform with a = sqrt(5), as nn.Linear), B zero, so the model starts as its base."""
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        full = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        if ".lora_A." in name:
            gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1.0 / math.sqrt(param.shape[-1])  # the input features: (rank, in), or (experts, rank, in)
            full.uniform_(-bound, bound, generator=gen)
        _copy_into(param, full)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (a plain, single-process model): the merged model."""
    for module in list(model.modules()):
        if isinstance(module, (LoRALinear, LoRAExperts)):
            module.merge()
    return model


def check_base(saved: dict | None, current: dict | None, where: str) -> str | None:
    """Why a commit (its trainer.json `adapter` record: `saved`) cannot resume this run (`current`), in one line
    naming both bases, or None: LoRA adapters resume only on the base they were trained on, and a LoRA run
    resumes no full fine-tune (nor the other way round)."""
    if saved is None and current is None:
        return None
    if saved is None:
        return (f"checkpoint {where} holds a full fine-tune, not LoRA adapters, and spec.model.adapter is set; "
                f"use a new checkpoint.uri for the adapters")
    if current is None:
        return (f"checkpoint {where} holds only LoRA adapters (of base {_named(saved['base'])}), and "
                f"spec.model.adapter is not set; set it to resume them, or use a new checkpoint.uri")
    if saved["base"] != current["base"]:
        return (f"checkpoint {where} holds LoRA adapters trained on base {_named(saved['base'])}, but this run's "
                f"base is {_named(current['base'])}; resume on that base, or use a new checkpoint.uri")
    return None


def _named(base: dict) -> str:
    return f"{base['uri']} (digest {base['digest']})"
