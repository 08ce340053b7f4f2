"""The apiserver's copy (CEL) of each kiln.api.layout rule, over every planned node count where it depends on
it, and the training schedule's own shape (warm-up within steps)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.api.layout import LAYOUT_RULES, LayoutRule, processes_per_node, spec_shape
from kiln.api.presets import PRESETS
from kiln.api.rules.common import MP, NODE_COUNTS, PPN, Rule, cel_model, cel_model_known, node_counts

if TYPE_CHECKING:
    from kiln.api.spec import TrainingSpecSpec


# kiln.api.layout.model_experts: 0 for a dense model; known unless model.from's config.json sets it
_MOE_EXPERTS = "(has(self.model.moe) && has(self.model.moe.experts))"
EXPERTS_KNOWN = f"(!has(self.model.from) || {_MOE_EXPERTS})"
EXPERTS = (f"({_MOE_EXPERTS} ? self.model.moe.experts : (has(self.model.preset) ? {{"
           + ", ".join(f"'{name}': {(dims.get('moe') or {}).get('experts', 0)}" for name, dims in PRESETS.items())
           + "}[self.model.preset] : 0))")

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
    "expert-needs-moe": f"self.parallelism.expert == 1 || !{EXPERTS_KNOWN} || {EXPERTS} > 0",
    "expert-divides-experts": f"!{EXPERTS_KNOWN} || {EXPERTS} == 0 || {EXPERTS} % self.parallelism.expert == 0",
    "expert-composes":
        "self.parallelism.expert == 1 || (self.parallelism.fsdp && !(has(self.elastic.faultTolerance) && "
        "self.elastic.faultTolerance.mode == 'replicaGroups'))",
    # kiln.api.layout.shard_size: dp / replicate with fsdp (an indivisible one is replicate's rule), else 1
    "expert-divides-shard":
        f"self.parallelism.fsdp ? {_AT_EACH}{_DP} % self.parallelism.replicate != 0 || "
        f"({_DP} / self.parallelism.replicate) % self.parallelism.expert == 0) : self.parallelism.expert == 1",
}
# Rules that hold whatever the world are checked by every run; those about the world the spec names
# (resources.nodes, the plan, processes per node) only where it runs so: `kiln run --nproc N` checks its own
# world of one node x N processes (kiln.api.layout.fit_local).
_WORLD_FREE = {"tensor-divides-heads", "pipeline-within-layers", "expert-needs-moe",
               "expert-divides-experts", "expert-composes"}


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


def _check_warmup(s):
    if s.training.warmup_steps > s.training.steps:
        return f"got warmupSteps={s.training.warmup_steps}, steps={s.training.steps}"
    return None


SHAPE_RULES: list[Rule] = [
    *(_layout_rule(r) for r in LAYOUT_RULES),
    Rule("warmup-within-steps", "training.warmupSteps",
         "training.warmupSteps must not exceed training.steps",
         "self.training.warmupSteps <= self.training.steps",
         _check_warmup),
]
