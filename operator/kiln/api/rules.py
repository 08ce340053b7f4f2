"""Cross-field rules of the TrainingSpec, written once and enforced twice.

Each `Rule` carries a CEL expression (the CRD generator puts it into `x-kubernetes-validations` of
`spec`, so the apiserver refuses the spec) and a Python check (run by pydantic, so `kiln validate`
and `kiln run` refuse the same spec). Both report the same field path and the same message, which
says what would be valid; the Python side adds the offending values.

CEL sees the spec after the apiserver applied the CRD defaults, so fields with a default are always
present; optional fields (no default) are guarded with has(). The helpers below spell the derived
values (effective processes per node, model dims from a preset) once for each language. The Python side of
the layout rules (which worlds a spec runs at) is kiln.api.layout's, which the operator and trainer call too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from kiln.api.layout import (LAYOUT_RULES, LayoutRule, divisors as _divisors, model_value, node_bounds,
                             processes_per_node, replica_groups, spec_shape)
from kiln.api.presets import PRESETS
from kiln.api.spec import DEFAULT_DATA_URI

if TYPE_CHECKING:
    from kiln.api.spec import TrainingSpecSpec

Scope = Literal["local", "cluster"]


@dataclass(frozen=True)
class Rule:
    """One cross-field rule: `field` is the path under `spec` (camelCase) that the error points at."""

    name: str
    field: str
    message: str  # what would be valid; the CRD's message and the start of the Python error
    cel: str  # over `self` = the spec object
    check: Callable[["TrainingSpecSpec"], str | None]  # None when fine, else the offending values
    # "cluster": only where the pods run on Kubernetes (the CRD, kiln validate, plan): the layout at the
    # world the spec names (`kiln run --nproc N` checks its own world instead)
    scope: Scope = "local"

    @property
    def path(self) -> str:
        return f"spec.{self.field}"


# ---- derived values, Python (the layout arithmetic lives in kiln.api.layout) ----

def model_complete(spec: "TrainingSpecSpec") -> bool:
    return spec.model.preset is not None or spec.model.from_ is not None or all(
        getattr(spec.model, f) is not None for f in ("dim", "layers", "heads", "vocab_size", "seq_len")
    )


def node_counts(spec: "TrainingSpecSpec") -> list[int]:
    """Node counts the run is planned with: the start count and every phase of the plan."""
    return [spec.resources.nodes] + [p.nodes for p in spec.elastic.plan]


# ---- derived values, CEL ----

PPN = ("(has(self.resources.processesPerNode) ? self.resources.processesPerNode : "
       "(self.resources.gpusPerNode > 0 ? self.resources.gpusPerNode : 1))")
MP = "(self.parallelism.tensor * self.parallelism.pipeline)"
MIN_NODES = "(has(self.elastic.minNodes) ? self.elastic.minNodes : self.resources.nodes)"
MAX_NODES = "(has(self.elastic.maxNodes) ? self.elastic.maxNodes : self.resources.nodes)"
NODE_COUNTS = "([self.resources.nodes] + self.elastic.plan.map(p, p.nodes))"
# kiln.api.layout.replica_groups(spec) > 1: replica groups are on
_FT_ON = ("(has(self.elastic.faultTolerance) && self.elastic.faultTolerance.mode == 'replicaGroups' && "
          "self.elastic.faultTolerance.groups > 1)")


def _cel_preset_map(field: str) -> str:
    return "{" + ", ".join(f"'{name}': {dims[field]}" for name, dims in PRESETS.items()) + "}"


def cel_model(field: str) -> str:
    """CEL for the effective model dimension `field` (snake_case); guard it with cel_model_known."""
    camel = re.sub(r"_(\w)", lambda m: m.group(1).upper(), field)
    preset = f"{_cel_preset_map(field)}[self.model.preset]"
    if field == "kv_heads":
        fallback = f"(has(self.model.preset) ? {preset} : self.model.heads)"
    else:
        fallback = preset
    return f"(has(self.model.{camel}) ? self.model.{camel} : {fallback})"


def cel_model_known(*fields: str) -> str:
    parts = []
    for field in dict.fromkeys("heads" if f == "kv_heads" else f for f in fields):
        camel = re.sub(r"_(\w)", lambda m: m.group(1).upper(), field)
        parts.append(f"(has(self.model.preset) || has(self.model.{camel}))")
    return "(" + " && ".join(parts) + ")"


# ---- the rules ----

def _check_model_complete(s):
    if not model_complete(s):
        missing = [f for f in ("dim", "layers", "heads", "vocabSize", "seqLen")
                   if getattr(s.model, re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), f)) is None]
        return f"missing: {', '.join(missing)}"
    return None


def _check_kv_heads(s):
    h, kv = model_value(s, "heads"), model_value(s, "kv_heads")
    if h is not None and kv is not None and h % kv:
        return f"got heads={h}, kvHeads={kv}; valid kvHeads: {_divisors(h)}"
    return None


def _check_dim(s):
    d, h = model_value(s, "dim"), model_value(s, "heads")
    if d is not None and h is not None and d % (2 * h):
        return f"got dim={d}, heads={h}; e.g. dim={2 * h * max(1, round(d / (2 * h)))}"
    return None


def _check_warmup(s):
    if s.training.warmup_steps > s.training.steps:
        return f"got warmupSteps={s.training.warmup_steps}, steps={s.training.steps}"
    return None


def _check_gpu_type(s):
    if s.resources.gpu_type and s.resources.gpus_per_node == 0:
        return f"got gpuType={shown(s.resources.gpu_type)} with gpusPerNode=0"
    return None


def _check_topology_queue(s):
    if s.scheduling.topology is not None and not s.scheduling.queue:
        return f"got topology level {shown(s.scheduling.topology.level)} without a queue"
    return None


def _check_gpu_label(s):
    # Label values match exactly; NVIDIA's product labels always carry capitals (NVIDIA-H200, Tesla-T4), so an
    # all-lower-case gpuType (README once said nvidia-h200) would select no node and the run would wait forever.
    gpu = s.resources.gpu_type
    return f"got gpuType={shown(gpu)}" if gpu and not re.search("[A-Z]", gpu) else None


def _check_min_nodes(s):
    e = s.elastic
    if e.min_nodes is not None and e.min_nodes > s.resources.nodes:
        return f"got minNodes={e.min_nodes}, nodes={s.resources.nodes}"
    return None


def _check_max_nodes(s):
    e = s.elastic
    if e.max_nodes is not None and e.max_nodes < s.resources.nodes:
        return f"got maxNodes={e.max_nodes}, nodes={s.resources.nodes}"
    return None


def _check_plan_shape(s):
    plan = s.elastic.plan
    if plan and (plan[-1].until_step is not None or any(p.until_step is None for p in plan[:-1])):
        return "got untilStep on entries " + ", ".join(
            f"{i}:{'set' if p.until_step is not None else 'unset'}" for i, p in enumerate(plan))
    return None


def _check_plan_order(s):
    steps = [p.until_step for p in s.elastic.plan if p.until_step is not None]
    if any(b <= a for a, b in zip(steps, steps[1:])):
        return f"got untilStep {steps}"
    return None


def _check_plan_nodes(s):
    lo, hi = node_bounds(s)
    bad = [p.nodes for p in s.elastic.plan if not lo <= p.nodes <= hi]
    if bad:
        return f"got nodes={bad[0]}, allowed [{lo}, {hi}]"
    return None


def _check_groups_divide_nodes(s):
    groups, nodes = replica_groups(s), s.resources.nodes
    return f"got groups={groups}, nodes={nodes}" if groups > 1 and nodes % groups else None


def _check_groups_fixed_size(s):
    if replica_groups(s) <= 1:
        return None
    lo, hi = node_bounds(s)
    got = [f"{k}={v}" for k, v in (("minNodes", lo), ("maxNodes", hi)) if v != s.resources.nodes]
    got += [f"a plan of {len(s.elastic.plan)} entries"] if s.elastic.plan else []
    return f"got {', '.join(got)} with {replica_groups(s)} groups, nodes={s.resources.nodes}" if got else None


def _check_store_uri(uri: str | None) -> str | None:
    if uri is not None and not uri.startswith(("s3://", "file://")):
        return f"got {shown(uri)}"
    return None


def _check_ckpt_uri(s):
    return _check_store_uri(s.checkpoint.uri)


def _check_interval(s):
    v = s.checkpoint.interval_steps
    if not isinstance(v, str) and v < 1:
        return f"got {v}"
    return None


def _check_from_preset(s):
    if s.model.from_ is not None and s.model.preset is not None:
        return f"got preset={s.model.preset!r}, from={s.model.from_!r}"
    return None


def _check_from_uri(s):
    return _check_store_uri(s.model.from_)


def _check_tokenizer(s):
    return None if s.data.tokenizer == "byte" else _check_store_uri(s.data.tokenizer)


def _data_uri_ok(uri: str) -> bool:
    return uri == "synthetic" or uri.startswith(("builtin:", "file://", "s3://"))


def _check_data_uri(s):
    return None if _data_uri_ok(s.data.uri) else f"got {shown(s.data.uri)}"


def _check_source_uris(s):
    bad = [src.uri for src in s.data.sources if not _data_uri_ok(src.uri)]
    return f"got {shown(bad[0])}" if bad else None


_FOLDER_CEL = "{x}.startsWith('file://') || {x}.startsWith('s3://')"
# data.uri, or every data.sources uri when there are sources, is a folder
_ALL_FOLDERS_CEL = (f"(size(self.data.sources) > 0 ? self.data.sources.all(s, {_FOLDER_CEL.format(x='s.uri')})"
                    f" : ({_FOLDER_CEL.format(x='self.data.uri')}))")


def _check_chat_folders(s):
    return _check_folders(s) if s.data.format == "chat" else None


def _check_packing_folders(s):
    return _check_folders(s) if s.data.packing else None


def _check_folders(s):
    uris = [src.uri for src in s.data.sources] or [s.data.uri]
    bad = [u for u in uris if not u.startswith(("file://", "s3://"))]
    return f"got {shown(bad[0])}" if bad else None


def _check_chat_tokenizer(s):
    if s.data.format != "chat" or s.model.from_ is not None or s.data.tokenizer not in (None, "byte"):
        return None
    return f"got tokenizer={shown(s.data.tokenizer)}, no model.from"


def _check_sources_or_uri(s):
    if s.data.sources and s.data.uri != DEFAULT_DATA_URI:
        return f"got uri={shown(s.data.uri)} and {len(s.data.sources)} sources"
    return None


def shown(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: errors quote the input, but never megabytes of it."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


# The apiserver's copy of each kiln.api.layout rule, over every planned node count where it depends on it.
_AT_EACH = f"{NODE_COUNTS}.all(n, (n * {PPN}) % {MP} != 0 || "
_DP = f"((n * {PPN}) / {MP})"
_PER_RANK = f"(self.training.globalBatchSize / {_DP})"
LAYOUT_CEL = {
    "tensor-divides-heads":
        f"!{cel_model_known('heads', 'kv_heads')} || ({cel_model('heads')} % self.parallelism.tensor == 0"
        f" && {cel_model('kv_heads')} % self.parallelism.tensor == 0)",
    "tensor-within-node": f"{PPN} % self.parallelism.tensor == 0",
    "pipeline-within-layers": f"!{cel_model_known('layers')} || self.parallelism.pipeline <= {cel_model('layers')}",
    "model-parallel-divides-world": f"{NODE_COUNTS}.all(n, (n * {PPN}) % {MP} == 0)",
    "replicate-divides-dp": f"!self.parallelism.fsdp || {_AT_EACH}{_DP} % self.parallelism.replicate == 0)",
    "batch-divides": f"{_AT_EACH}self.training.globalBatchSize % (self.training.microBatchSize * {_DP}) == 0)",
    "pipeline-microbatches":
        f"self.parallelism.pipeline == 1 || {_AT_EACH}(has(self.parallelism.pipelineMicrobatches) ? "
        f"({_PER_RANK} % self.parallelism.pipelineMicrobatches == 0 && "
        f"self.parallelism.pipelineMicrobatches >= self.parallelism.pipeline) : "
        f"{_PER_RANK} >= self.parallelism.pipeline))",
    "ft-groups-divide-dp":
        "!has(self.elastic.faultTolerance) || self.elastic.faultTolerance.mode != 'replicaGroups' || "
        f"{_AT_EACH}{_DP} % self.elastic.faultTolerance.groups == 0)",
}
# Rules that hold whatever the world are checked by every run; those about the world the spec names
# (resources.nodes, the plan, processes per node) only where it runs so: `kiln run --nproc N` checks its own
# world of one node x N processes (kiln.api.layout.fit_local).
_WORLD_FREE = {"tensor-divides-heads", "pipeline-within-layers"}


def _layout_rule(r: LayoutRule) -> Rule:
    def check(s: "TrainingSpecSpec") -> str | None:
        shape, ppn = spec_shape(s), processes_per_node(s)
        for n in node_counts(s) if r.per_world else [s.resources.nodes]:
            detail = r.check(s, shape, n, ppn)
            if detail is not None:
                return detail
        return None

    where = " for resources.nodes and every elastic.plan entry" if r.per_world else ""
    return Rule(r.name, r.field, r.message + where, LAYOUT_CEL[r.name], check,
                scope="local" if r.name in _WORLD_FREE else "cluster")


RULES: list[Rule] = [
    Rule("model-complete", "model",
         "set model.preset, model.from, or all of model.dim, layers, heads, vocabSize and seqLen",
         "has(self.model.preset) || has(self.model.from) || (has(self.model.dim) && has(self.model.layers) && has(self.model.heads)"
         " && has(self.model.vocabSize) && has(self.model.seqLen))",
         _check_model_complete),
    Rule("model-from-or-preset", "model.from",
         "model.from and model.preset exclude each other: the model folder's config.json sets the dimensions",
         "!has(self.model.from) || !has(self.model.preset)",
         _check_from_preset),
    Rule("model-from-scheme", "model.from",
         "model.from must be a model folder: file:///path/ or s3://bucket/prefix/",
         "!has(self.model.from) || self.model.from.startsWith('s3://') || self.model.from.startsWith('file://')",
         _check_from_uri),
    Rule("kv-heads-divide-heads", "model.kvHeads",
         "model.kvHeads must divide model.heads (grouped-query attention)",
         f"!{cel_model_known('heads', 'kv_heads')} || {cel_model('heads')} % {cel_model('kv_heads')} == 0",
         _check_kv_heads),
    Rule("dim-multiple-of-heads", "model.dim",
         "model.dim must be a multiple of 2 × model.heads (an even head size for rotary embeddings)",
         f"!{cel_model_known('dim', 'heads')} || {cel_model('dim')} % (2 * {cel_model('heads')}) == 0",
         _check_dim),
    *(_layout_rule(r) for r in LAYOUT_RULES),
    Rule("warmup-within-steps", "training.warmupSteps",
         "training.warmupSteps must not exceed training.steps",
         "self.training.warmupSteps <= self.training.steps",
         _check_warmup),
    Rule("gpu-type-needs-gpus", "resources.gpuType",
         "resources.gpuType needs resources.gpusPerNode > 0",
         "!has(self.resources.gpuType) || self.resources.gpusPerNode > 0",
         _check_gpu_type),
    Rule("gpu-type-label", "resources.gpuType",
         "resources.gpuType must be the nodes' nvidia.com/gpu.product label value, which is case-sensitive and "
         "spells NVIDIA's products with capitals, e.g. NVIDIA-H200 (kubectl get nodes -L nvidia.com/gpu.product)",
         "!has(self.resources.gpuType) || self.resources.gpuType.matches('[A-Z]')",
         _check_gpu_label, scope="cluster"),
    Rule("topology-needs-queue", "scheduling.topology",
         "scheduling.topology needs scheduling.queue: Kueue places only the runs it admits from a queue",
         "!has(self.scheduling.topology) || has(self.scheduling.queue)",
         _check_topology_queue),
    Rule("min-nodes", "elastic.minNodes",
         "elastic.minNodes must be at most resources.nodes",
         "!has(self.elastic.minNodes) || self.elastic.minNodes <= self.resources.nodes",
         _check_min_nodes),
    Rule("max-nodes", "elastic.maxNodes",
         "elastic.maxNodes must be at least resources.nodes",
         "!has(self.elastic.maxNodes) || self.elastic.maxNodes >= self.resources.nodes",
         _check_max_nodes),
    Rule("plan-shape", "elastic.plan",
         "every elastic.plan entry but the last needs untilStep; the last has none (it runs to the end)",
         "size(self.elastic.plan) == 0 || (!has(self.elastic.plan[size(self.elastic.plan) - 1].untilStep)"
         " && self.elastic.plan.filter(p, !has(p.untilStep)).size() == 1)",
         _check_plan_shape),
    Rule("plan-order", "elastic.plan",
         "elastic.plan untilStep values must strictly increase",
         "self.elastic.plan.filter(p, has(p.untilStep)).map(p, p.untilStep).isSorted() && "
         "self.elastic.plan.filter(p, has(p.untilStep)).all(a, "
         "self.elastic.plan.filter(b, has(b.untilStep) && b.untilStep == a.untilStep).size() == 1)",
         _check_plan_order),
    Rule("plan-nodes-in-range", "elastic.plan",
         "every elastic.plan entry's nodes must lie in [elastic.minNodes, elastic.maxNodes] "
         "(each defaults to resources.nodes)",
         f"self.elastic.plan.all(p, p.nodes >= {MIN_NODES} && p.nodes <= {MAX_NODES})",
         _check_plan_nodes),
    # Replica groups on Kubernetes: each group is a PyTorchJob of whole nodes at a fixed size (kiln.control.plan
    # renders nodes / groups per job; node-count elasticity does not act per group yet). `kiln run` is one node.
    Rule("ft-groups-divide-nodes", "elastic.faultTolerance.groups",
         "with elastic.faultTolerance.mode replicaGroups, elastic.faultTolerance.groups must divide "
         "resources.nodes: each replica group is a PyTorchJob of whole nodes (nodes / groups each)",
         f"!{_FT_ON} || self.resources.nodes % self.elastic.faultTolerance.groups == 0",
         _check_groups_divide_nodes, scope="cluster"),
    Rule("ft-groups-fixed-size", "elastic.faultTolerance",
         "elastic.minNodes, elastic.maxNodes (other than resources.nodes) and elastic.plan are not supported with "
         "elastic.faultTolerance.mode replicaGroups yet: each group runs at a fixed nodes / groups; leave them unset",
         f"!{_FT_ON} || ({MIN_NODES} == self.resources.nodes && {MAX_NODES} == self.resources.nodes"
         " && size(self.elastic.plan) == 0)",
         _check_groups_fixed_size, scope="cluster"),
    Rule("checkpoint-uri-scheme", "checkpoint.uri",
         "checkpoint.uri must start with s3:// or file://",
         "!has(self.checkpoint.uri) || self.checkpoint.uri.startsWith('s3://')"
         " || self.checkpoint.uri.startsWith('file://')",
         _check_ckpt_uri),
    Rule("checkpoint-interval", "checkpoint.intervalSteps",
         "checkpoint.intervalSteps must be a positive integer or 'auto'",
         "type(self.checkpoint.intervalSteps) == string ? self.checkpoint.intervalSteps == 'auto'"
         " : self.checkpoint.intervalSteps >= 1",
         _check_interval),
    Rule("data-uri-scheme", "data.uri",
         "data.uri must be 'synthetic', builtin:<name>, file:///path/ or s3://bucket/prefix/",
         "self.data.uri == 'synthetic' || self.data.uri.startsWith('builtin:')"
         " || self.data.uri.startsWith('file://') || self.data.uri.startsWith('s3://')",
         _check_data_uri),
    Rule("data-source-uri-scheme", "data.sources",
         "every data.sources uri must be 'synthetic', builtin:<name>, file:///path/ or s3://bucket/prefix/",
         "self.data.sources.all(s, s.uri == 'synthetic' || s.uri.startsWith('builtin:')"
         " || s.uri.startsWith('file://') || s.uri.startsWith('s3://'))",
         _check_source_uris),
    Rule("data-sources-or-uri", "data.sources",
         "data.sources replaces data.uri: leave data.uri unset when data.sources is set",
         f"size(self.data.sources) == 0 || self.data.uri == '{DEFAULT_DATA_URI}'",
         _check_sources_or_uri),
    Rule("data-chat-folders", "data.format",
         "data.format chat trains on conversations prepared with kiln data prepare --format chat: data.uri (or "
         "every data.sources uri) must be a folder, file:///path/ or s3://bucket/prefix/",
         f"self.data.format != 'chat' || {_ALL_FOLDERS_CEL}",
         _check_chat_folders),
    Rule("data-packing-folders", "data.packing",
         "data.packing packs the documents of shards prepared with kiln data prepare: data.uri (or every "
         "data.sources uri) must be a folder, file:///path/ or s3://bucket/prefix/",
         f"!self.data.packing || {_ALL_FOLDERS_CEL}",
         _check_packing_folders),
    Rule("data-chat-tokenizer", "data.format",
         "data.format chat renders conversations with a chat template: set data.tokenizer (not 'byte') or "
         "model.from to a model folder whose tokenizer has one",
         "self.data.format != 'chat' || has(self.model.from) || (has(self.data.tokenizer) && self.data.tokenizer != 'byte')",
         _check_chat_tokenizer),
    Rule("data-tokenizer", "data.tokenizer",
         "data.tokenizer must be 'byte', or a tokenizer.json or model folder at file://... or s3://...",
         "!has(self.data.tokenizer) || self.data.tokenizer == 'byte' || self.data.tokenizer.startsWith('s3://')"
         " || self.data.tokenizer.startsWith('file://')",
         _check_tokenizer),
]

# The document-level rule: the name becomes the PyTorchJob's, its pods' and services' names.
NAME_MAX = 45
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_MESSAGE = (f"metadata.name must be a DNS-1035 label of at most {NAME_MAX} characters "
                "(lower-case letters, digits and '-', starting with a letter), e.g. llama-1b")
NAME_CEL = f"size(self.metadata.name) <= {NAME_MAX} && self.metadata.name.matches('{NAME_PATTERN}')"


def check(spec: "TrainingSpecSpec", scope: Scope | Literal["all"] = "all") -> list[str]:
    """Every broken rule as 'spec.<field>: <what is valid> (<the offending values>)'."""
    problems = []
    for rule in RULES:
        if scope == "local" and rule.scope != "local":
            continue
        detail = rule.check(spec)
        if detail is not None:
            problems.append(f"{rule.path}: {rule.message} ({detail})")
    return problems


def check_name(name: str) -> list[str]:
    if len(name) > NAME_MAX or not re.match(NAME_PATTERN, name):
        return [f"{NAME_MESSAGE} (got {shown(name)})"]
    return []
