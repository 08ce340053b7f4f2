"""The layout arithmetic, written once: at which worlds a TrainingSpec can run, and how it splits one.

A world is `nodes` x `processes per node`. Every side asks this module, so they cannot disagree:
- kiln.api.rules: `kiln validate` and pydantic check the spec at resources.nodes and every elastic.plan
  entry (the CEL there is the apiserver's copy of the same rules; tests/integration/test_operator_api.py
  compares the two on random specs);
- kiln.control.elastic: the node counts in [minNodes, maxNodes] the operator may choose (`runnable`);
- kiln.control.plan.resolve: the bounds it writes (`node_bounds`);
- kiln.trainer.parallel.parallelize.plan_layout: the world torchrun started (`plan`);
- `kiln run SPEC --nproc N`: one node x N processes (`fit_local`).
Pure and torch-free: plain values in, a Layout or a problem naming the field out.
One module on purpose (~430 lines): every side must read the same arithmetic, and splitting it would invite
a second copy of a rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from kiln.api.presets import PRESETS
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.api.presets import ModelDims
    from kiln.api.spec import FaultToleranceSpec, TrainingSpecSpec


@dataclass(frozen=True)
class Layout:
    """How a world splits: pp x dp_replicate x dp_shard x tp processes, and the batch of one rank."""

    world: int
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    micro_batch: int
    grad_accum: int  # microbatches per optimizer step on one data-parallel rank
    pp_microbatches: int  # microbatches the pipeline schedule splits a rank's batch into (1 without pp)
    ep: int = 1  # expert parallel: borrowed from dp_shard (each EP rank still reads its own data)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def as_dict(self) -> dict:
        return {"world": self.world, "pp": self.pp, "dp_replicate": self.dp_replicate,
                "dp_shard": self.dp_shard, "tp": self.tp, "ep": self.ep}


@dataclass(frozen=True)
class Shape:
    """The model dimensions a layout depends on; None where unknown (model.from, until its config.json is read)."""

    heads: int | None = None
    kv_heads: int | None = None
    layers: int | None = None
    experts: int | None = 0  # 0: a dense model; None: unknown (model.from, until its config.json is read)


class LayoutError(KilnError):
    """A world the spec cannot run at; the message starts with the field (or flag) to change."""


# ---- derived values ----

def processes_per_node(spec: "TrainingSpecSpec") -> int:
    r = spec.resources
    return r.processes_per_node or (r.gpus_per_node if r.gpus_per_node > 0 else 1)


def node_bounds(spec: "TrainingSpecSpec") -> tuple[int, int]:
    """[elastic.minNodes, elastic.maxNodes], each defaulting to resources.nodes."""
    e, n = spec.elastic, spec.resources.nodes
    return (e.min_nodes if e.min_nodes is not None else n), (e.max_nodes if e.max_nodes is not None else n)


def model_value(spec: "TrainingSpecSpec", field: str) -> int | None:
    """The effective model dimension (explicit, else from the preset, kvHeads else heads); None if unknown."""
    m = spec.model
    value = getattr(m, field)
    if value is not None:
        return value
    if m.preset is not None:
        return PRESETS[m.preset].get(field)
    if field == "kv_heads":
        return m.heads
    return None


def model_experts(spec: "TrainingSpecSpec") -> int | None:
    """The spec's number of experts (model.moe.experts, else its preset's): 0 for a dense model, None while
    unknown (model.from's config.json says)."""
    m = spec.model
    moe = getattr(m, "moe", None)
    if moe is not None and moe.experts is not None:
        return moe.experts
    if m.from_ is not None:
        return None
    return (PRESETS[m.preset].get("moe") or {}).get("experts", 0) if m.preset is not None else 0


def spec_shape(spec: "TrainingSpecSpec") -> Shape:
    return Shape(model_value(spec, "heads"), model_value(spec, "kv_heads"), model_value(spec, "layers"),
                 model_experts(spec))


def dims_shape(dims: "ModelDims") -> Shape:
    moe = getattr(dims, "moe", None)
    return Shape(dims.heads, dims.kv_heads, dims.layers, moe.experts if moe is not None else 0)


def shard_size(spec: "TrainingSpecSpec", world: int) -> int | None:
    """FSDP's shard size, dp_shard = data-parallel size / replicate (1 without fsdp); None when dp does not divide."""
    dp, par = data_parallel(spec, world), spec.parallelism
    if dp is None or (par.fsdp and dp % par.replicate):
        return None
    return dp // par.replicate if par.fsdp else 1


def data_parallel(spec: "TrainingSpecSpec", world: int) -> int | None:
    """world / (tensor x pipeline); None when that does not divide."""
    mp = spec.parallelism.tensor * spec.parallelism.pipeline
    return world // mp if world % mp == 0 else None


def fault_tolerance_groups(ft: "FaultToleranceSpec | None") -> int | None:
    """The one place the fault-tolerance mode is decided: elastic.faultTolerance's replica groups when its mode
    is replicaGroups, else None (off). The trainer's membership, the CLI and the operator's plan ask here."""
    return ft.groups if ft is not None and ft.mode == "replicaGroups" else None


def replica_groups_on(spec: "TrainingSpecSpec") -> bool:
    """elastic.faultTolerance mode replicaGroups (even of one group: a job of its own torchft quorum)."""
    return fault_tolerance_groups(spec.elastic.fault_tolerance) is not None


def replica_groups(spec: "TrainingSpecSpec") -> int:
    """elastic.faultTolerance: how many replica groups the data-parallel dimension splits into (1: mode off)."""
    return fault_tolerance_groups(spec.elastic.fault_tolerance) or 1


def replica_group_spec(spec: "TrainingSpecSpec") -> "TrainingSpecSpec":
    """The spec one replica group runs as its own job: globalBatchSize / groups sequences per step, no
    faultTolerance; its layout is `plan` at the group's world (world / groups)."""
    groups = replica_groups(spec)
    if groups == 1:
        return spec
    training = spec.training.model_copy(update={"global_batch_size": spec.training.global_batch_size // groups})
    elastic = spec.elastic.model_copy(update={"fault_tolerance": None})
    return spec.model_copy(update={"training": training, "elastic": elastic})


def default_pipeline_microbatches(per_rank: int, pipeline: int, accum: int) -> int:
    """The fewest microbatches >= min(per_rank, max(2 x pipeline, accumulation)) that split the per_rank
    sequences evenly: always a divisor of per_rank, so the default fits whenever per_rank >= pipeline."""
    want = min(per_rank, max(2 * pipeline, accum))
    if want <= 1:
        return 1
    # per_rank itself always divides; the scan is bounded so a hostile batch size cannot stall anything
    return next((d for d in range(want, min(per_rank, want + 10**6) + 1) if per_rank % d == 0), per_rank)


# ---- the rules ----

@dataclass(frozen=True)
class LayoutRule:
    """One condition on (spec, model shape, world): `field` is the path under spec the error points at."""

    name: str
    field: str
    message: str  # what would be valid (also the CRD rule's message, kiln.api.rules)
    check: Callable[["TrainingSpecSpec", Shape, int, int], str | None]  # (spec, shape, nodes, ppn) -> detail
    per_world: bool  # depends on the node count: checked at resources.nodes and every elastic.plan entry


def _at(nodes: int, ppn: int) -> str:
    return f"{nodes} node(s) × {ppn} process(es) = world {nodes * ppn}"


def divisors(n: int) -> str:
    """'1, 2, 4' (for an error's 'valid ...: ' hint)."""
    if n > 10**8:  # finding them costs sqrt(n) steps: 10^4 here; an int64 would take minutes
        return f"the divisors of {n}"
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return ", ".join(str(d) for d in sorted(set(small + [n // d for d in small])))


def _tensor_heads(s, shape, nodes, ppn):
    t, h, kv = s.parallelism.tensor, shape.heads, shape.kv_heads
    if h is not None and kv is not None and (h % t or kv % t):
        return f"got tensor={t}, heads={h}, kvHeads={kv}; valid tensor: {divisors(math.gcd(h, kv))}"
    return None


def _tensor_node(s, shape, nodes, ppn):
    t = s.parallelism.tensor
    if ppn % t:
        return f"got tensor={t}, processes per node={ppn}; valid tensor: {divisors(ppn)}"
    return None


def _pipeline_layers(s, shape, nodes, ppn):
    p = s.parallelism.pipeline
    if shape.layers is not None and p > shape.layers:
        return f"got pipeline={p}, layers={shape.layers}"
    return None


def _world(s, shape, nodes, ppn):
    t, p = s.parallelism.tensor, s.parallelism.pipeline
    if (nodes * ppn) % (t * p):
        return f"got tensor×pipeline={t * p} at {_at(nodes, ppn)}"
    return None


def _replicate(s, shape, nodes, ppn):
    r, dp = s.parallelism.replicate, data_parallel(s, nodes * ppn)
    if s.parallelism.fsdp and dp is not None and dp % r:
        return f"got replicate={r}, data-parallel size={dp} at {_at(nodes, ppn)}; valid replicate: {divisors(dp)}"
    return None


def _batch(s, shape, nodes, ppn):
    g, mb, dp = s.training.global_batch_size, s.training.micro_batch_size, data_parallel(s, nodes * ppn)
    if dp is not None and g % (mb * dp):
        return (f"got globalBatchSize={g}, microBatchSize={mb}, data-parallel size={dp} at {_at(nodes, ppn)}; "
                f"e.g. globalBatchSize={mb * dp * max(1, round(g / (mb * dp)))}")
    return None


def _pipeline_microbatches(s, shape, nodes, ppn):
    # Integer division, as the CEL copy computes it: an indivisible batch is the batch rule's to report.
    p, n_mb, dp = s.parallelism.pipeline, s.parallelism.pipeline_microbatches, data_parallel(s, nodes * ppn)
    if p == 1 or dp is None:
        return None
    per_rank = s.training.global_batch_size // dp
    if n_mb is None:
        if per_rank < p:
            return f"got {per_rank} sequence(s) per data-parallel rank, pipeline={p} at {_at(nodes, ppn)}"
    elif per_rank % n_mb or n_mb < p:
        return (f"got pipelineMicrobatches={n_mb}, pipeline={p}, {per_rank} sequence(s) per data-parallel rank "
                f"at {_at(nodes, ppn)}")
    return None


def _ft_groups(s, shape, nodes, ppn):
    g, dp = replica_groups(s), data_parallel(s, nodes * ppn)
    if dp is not None and dp % g:
        return f"got groups={g}, data-parallel size={dp} at {_at(nodes, ppn)}; valid groups: {divisors(dp)}"
    return None


def _expert_model(s, shape, nodes, ppn):
    e = s.parallelism.expert
    if e > 1 and shape.experts == 0:
        return f"got expert={e} with a dense model"
    return None


def _expert_divides_experts(s, shape, nodes, ppn):
    e, n = s.parallelism.expert, shape.experts
    if n and n % e:
        return f"got expert={e}, experts={n}; valid expert: {divisors(n)}"
    return None


def _expert_composes(s, shape, nodes, ppn):
    par = s.parallelism
    if par.expert > 1 and (not par.fsdp or replica_groups_on(s)):
        return (f"got expert={par.expert} with fsdp={par.fsdp}, "
                f"faultTolerance {'replicaGroups' if replica_groups_on(s) else 'off'}")
    return None


def _expert_shard(s, shape, nodes, ppn):
    e, shard = s.parallelism.expert, shard_size(s, nodes * ppn)
    if shard is not None and shard % e:
        return f"got expert={e}, FSDP shard size={shard} at {_at(nodes, ppn)}; valid expert: {divisors(shard)}"
    return None


LAYOUT_RULES: list[LayoutRule] = [
    LayoutRule("tensor-divides-heads", "parallelism.tensor",
               "parallelism.tensor must divide model.heads and model.kvHeads", _tensor_heads, False),
    LayoutRule("tensor-within-node", "parallelism.tensor",
               "parallelism.tensor must divide the processes per node (resources.processesPerNode, default "
               "gpusPerNode): tensor parallelism stays inside a node", _tensor_node, False),
    LayoutRule("pipeline-within-layers", "parallelism.pipeline",
               "parallelism.pipeline must not exceed model.layers", _pipeline_layers, False),
    LayoutRule("model-parallel-divides-world", "parallelism",
               "parallelism.tensor × parallelism.pipeline must divide the world size (nodes × processes per node)",
               _world, True),
    LayoutRule("replicate-divides-dp", "parallelism.replicate",
               "with parallelism.fsdp, parallelism.replicate must divide the data-parallel size "
               "(world / (tensor × pipeline))", _replicate, True),
    LayoutRule("batch-divides", "training.globalBatchSize",
               "training.globalBatchSize must be a multiple of microBatchSize × the data-parallel size "
               "(world / (tensor × pipeline))", _batch, True),
    LayoutRule("pipeline-microbatches", "parallelism.pipelineMicrobatches",
               "with parallelism.pipeline > 1, each data-parallel rank's sequences (globalBatchSize / data-parallel "
               "size) must split evenly into parallelism.pipelineMicrobatches, at least one per pipeline stage "
               "(unset: chosen to split evenly, which needs at least as many sequences as stages)",
               _pipeline_microbatches, True),
    LayoutRule("ft-groups-divide-dp", "elastic.faultTolerance.groups",
               "with elastic.faultTolerance.mode replicaGroups, elastic.faultTolerance.groups must divide the "
               "data-parallel size (world / (tensor × pipeline)): every replica group holds the same layout",
               _ft_groups, True),
    LayoutRule("expert-needs-moe", "parallelism.expert",
               "parallelism.expert > 1 needs a mixture-of-experts model (model.moe, or a preset or model.from with experts)", _expert_model, False),
    LayoutRule("expert-divides-experts", "parallelism.expert",
               "parallelism.expert must divide model.moe.experts: every expert-parallel rank holds as many experts",
               _expert_divides_experts, False),
    LayoutRule("expert-composes", "parallelism.expert",
               "parallelism.expert > 1 needs parallelism.fsdp and no elastic.faultTolerance replica groups: "
               "expert parallelism borrows FSDP's shard ranks and is not yet composed with replica groups",
               _expert_composes, False),
    LayoutRule("expert-divides-shard", "parallelism.expert",
               "parallelism.expert must divide the FSDP shard size (world / (tensor × pipeline × replicate)): the "
               "expert-parallel ranks are data-parallel ranks", _expert_shard, True),
]


def problems(spec: "TrainingSpecSpec", nodes: int, ppn: int | None = None, shape: Shape | None = None) -> list[str]:
    """Every layout rule `spec` breaks at nodes x ppn processes, as 'spec.<field>: <what is valid> (<values>)'.

    ppn defaults to the spec's processes per node, shape to the spec's own model fields."""
    ppn = processes_per_node(spec) if ppn is None else ppn
    shape = spec_shape(spec) if shape is None else shape
    out = []
    for rule in LAYOUT_RULES:
        detail = rule.check(spec, shape, nodes, ppn)
        if detail is not None:
            out.append(f"spec.{rule.field}: {rule.message} ({detail})")
    return out


def runnable(spec: "TrainingSpecSpec", nodes: int) -> bool:
    """Whether the run can start on `nodes` nodes (of the spec's processes per node)."""
    return nodes >= 1 and not problems(spec, nodes)


def runnable_node_counts(spec: "TrainingSpecSpec") -> list[int]:
    """The node counts in [minNodes, maxNodes] the run can start at."""
    lo, hi = node_bounds(spec)
    return [n for n in range(lo, hi + 1) if runnable(spec, n)]


def plan(spec: "TrainingSpecSpec", nodes: int, ppn: int | None = None, shape: Shape | None = None) -> Layout:
    """The layout at nodes x ppn processes; LayoutError naming every field that does not fit."""
    found = problems(spec, nodes, ppn, shape)
    if found:
        raise LayoutError("\n".join(found))
    ppn = processes_per_node(spec) if ppn is None else ppn
    par, tr = spec.parallelism, spec.training
    world = nodes * ppn
    dp = world // (par.tensor * par.pipeline)
    replicate, shard = (par.replicate, dp // par.replicate) if par.fsdp else (dp, 1)
    accum = tr.global_batch_size // (tr.micro_batch_size * dp)
    n_mb = 1
    if par.pipeline > 1:
        per_rank = tr.global_batch_size // dp
        n_mb = par.pipeline_microbatches or default_pipeline_microbatches(per_rank, par.pipeline, accum)
    return Layout(world, par.pipeline, replicate, shard, par.tensor, tr.micro_batch_size, accum, n_mb, par.expert)


# ---- one machine: `kiln run SPEC --nproc N` ----

def fit_local(spec: "TrainingSpecSpec", nproc: int) -> tuple[dict, list[str]]:
    """What changes when a spec written for any cluster runs here as one node x `nproc` processes.

    Returns (a camelCase patch of the spec, notes to print). The global batch is kept: the micro-batch
    shrinks to a divisor when it no longer fits, and gradient accumulation makes up the rest; replicate, expert
    and pipelineMicrobatches, written for the cluster's data-parallel size, fall back to what fits. Refused, with
    the flag named, only what cannot run on `nproc` processes at that global batch.
    """
    par, tr = spec.parallelism, spec.training
    mp = par.tensor * par.pipeline
    if nproc % mp:
        fits = ", ".join(str(mp * k) for k in range(1, 5))
        raise LayoutError(f"--nproc {nproc}: parallelism.tensor × parallelism.pipeline = {mp} must divide the "
                          f"number of local processes; use --nproc {fits}, ...")
    dp, g = nproc // mp, tr.global_batch_size
    if g % dp:
        fits = ", ".join(str(mp * d) for d in range(1, min(g, 64) + 1) if g % d == 0)
        raise LayoutError(f"--nproc {nproc}: the global batch of {g} sequences (training.globalBatchSize) does not "
                          f"split over {dp} data-parallel ranks (--nproc / (tensor × pipeline)); use --nproc {fits}")
    per_rank = g // dp
    if par.pipeline > 1 and per_rank < par.pipeline:
        raise LayoutError(f"--nproc {nproc}: each data-parallel rank gets {per_rank} sequence(s), fewer than the "
                          f"{par.pipeline} pipeline stages; use fewer processes or a larger training.globalBatchSize")
    patch: dict = {"resources": {"nodes": 1, "processesPerNode": nproc}, "training": {}, "parallelism": {}}
    notes: list[str] = []
    micro = tr.micro_batch_size
    if per_rank % micro:  # the largest divisor below it (a bounded scan: 1 always divides)
        top = min(micro, per_rank)
        micro = next((d for d in range(top, max(1, top - 10**6), -1) if per_rank % d == 0), 1)
    if micro != tr.micro_batch_size:
        patch["training"]["microBatchSize"] = micro
        notes.append(f"training.microBatchSize {tr.micro_batch_size} → {micro}: with {dp} data-parallel rank(s) "
                     f"each gets {per_rank} of the {g} sequences; gradient accumulation keeps the global batch")
    replicate = par.replicate
    if par.fsdp and dp % par.replicate:
        replicate = math.gcd(dp, par.replicate)
        patch["parallelism"]["replicate"] = replicate
        notes.append(f"parallelism.replicate {par.replicate} → {replicate}: it must divide the {dp} local "
                     f"data-parallel rank(s)")
    shard = dp // replicate if par.fsdp else 1
    if shard % par.expert:  # a divisor of expert still divides the experts
        expert = math.gcd(shard, par.expert)
        patch["parallelism"]["expert"] = expert
        notes.append(f"parallelism.expert {par.expert} → {expert}: it must divide the {shard} local FSDP shard "
                     f"rank(s)")
    n_mb = par.pipeline_microbatches
    if par.pipeline > 1 and n_mb is not None and (per_rank % n_mb or n_mb < par.pipeline):
        patch["parallelism"]["pipelineMicrobatches"] = None
        notes.append(f"parallelism.pipelineMicrobatches {n_mb} → the default: {n_mb} does not split the "
                     f"{per_rank} sequences of each local data-parallel rank")
    return patch, notes
