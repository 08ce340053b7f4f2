"""Rules on where and how many pods run: resources.gpuType, scheduling.topology, elastic node bounds and
plan, and replica groups (elastic.faultTolerance)."""

from __future__ import annotations

import re

from kiln.api.layout import node_bounds, replica_groups
from kiln.api.rules.common import FT_ON, MAX_NODES, MIN_NODES, Rule, shown


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



PLACEMENT_RULES: list[Rule] = [
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
         f"!{FT_ON} || self.resources.nodes % self.elastic.faultTolerance.groups == 0",
         _check_groups_divide_nodes, scope="cluster"),
    Rule("ft-groups-fixed-size", "elastic.faultTolerance",
         "elastic.minNodes, elastic.maxNodes (other than resources.nodes) and elastic.plan are not supported with "
         "elastic.faultTolerance.mode replicaGroups yet: each group runs at a fixed nodes / groups; leave them unset",
         f"!{FT_ON} || ({MIN_NODES} == self.resources.nodes && {MAX_NODES} == self.resources.nodes"
         " && size(self.elastic.plan) == 0)",
         _check_groups_fixed_size, scope="cluster"),
]
