"""plan(spec, observed, config) → the objects a TrainingSpec should have. Pure: no I/O, no clock.

One TrainingSpec becomes, all owned by it (deleting it deletes them):
  ServiceAccount/Role/RoleBinding `<name>-trainer`  rank 0 may get/patch this run's status, nothing else
  NetworkPolicy `<name>-trainer`                    only the run's own pods reach its pods (metrics port: the
                                                    monitoring namespace's pods)
  ConfigMap `<name>-spec`                           the resolved spec (every default filled), read by the pods
  PyTorchJob `<name>`                               kubeflow.org/v1, elastic, one Worker pod per node
The PyTorchJobs come from the run's layout part (kiln.control.parts): SingleJob renders the one above; with
elastic.faultTolerance replicaGroups (kiln.control.replica_groups), instead of that one PyTorchJob:
  PyTorchJob `<name>-g<i>`, i < groups               one per replica group, nodes / groups Worker pods each:
                                                    a group restarts alone, the others step on
  Deployment + Service `<name>-lighthouse`          torchft's lighthouse (the trainer image has it), which
                                                    forms each step's quorum of the live groups
  NetworkPolicy `<name>-lighthouse`                 only the run's trainer pods reach it
  Secret `<name>-ft`                                the run's secret, which the lighthouse asks each group to
                                                    prove (kiln.control.ft_secret; created once, never applied)
Every object is a plain dict ready for server-side apply; reconciling twice applies the same dicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from kiln.api.contract import SPEC_FILE
from kiln.api.layout import node_bounds, processes_per_node
from kiln.api.presets import resolve_model
from kiln.api.rules import check
from kiln.api.spec import API_VERSION, KIND, MoESpec, TrainingSpec
from kiln.control import pods
from kiln.control.config import OperatorConfig
# names other modules and tests read here (kept importable from the plan)
from kiln.control.names import GROUP_LABEL, LIGHTHOUSE_LABEL, MANAGED_BY, RUN_LABEL, job_names, names  # noqa: F401
from kiln.control.observed import Observed
from kiln.control.parts import layout_of, layout_of_stored
from kiln.control.policy import violations
from kiln.control.pytorchjob import (GPU, KUEUE_PRIORITY_LABEL, KUEUE_QUEUE_LABEL, S3_KEYS, TMP_DIR,  # noqa: F401
                                     TORCHRUN_ENV, WRITABLE_ENV, trainer_identity, trainer_network_policy)
from kiln.control.replica_groups import (LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS, LIGHTHOUSE_JOIN_TIMEOUT_MS,  # noqa: F401
                                         LIGHTHOUSE_PORT)
from kiln.control.requests import LEFT_OUT_WHY, pod_resources, quantity_bytes, queue_fit  # noqa: F401
from kiln.errors import KilnError

# libyaml's emitter when present (same text, ~4x faster: the largest cost of a plan in a burst)
SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

# Changing these under a running job would silently break it (the checkpoint no longer fits the model,
# the data cursor no longer means anything): the operator refuses the change instead of applying it.
IMMUTABLE_WHILE_RUNNING = (
    ("model",), ("data", "uri"), ("parallelism", "tensor"), ("parallelism", "pipeline"),
    ("resources", "gpusPerNode"), ("resources", "processesPerNode"),
    ("elastic", "faultTolerance"),  # one PyTorchJob or one per group: the running ones would stay beside the new
)


@dataclass
class Plan:
    objects: list[dict[str, Any]] = field(default_factory=list)
    refused: str | None = None  # why nothing is applied: a spec change the running job cannot absorb, or ...
    refused_reason: str = "ImmutableFieldChanged"  # ... ForbiddenByPolicy (kiln.control.policy), NotCoveredByQueue
    notes: list[str] = field(default_factory=list)  # what the user should know about an applied plan
















def job_names_of(body: dict) -> list[str]:
    """The PyTorchJobs of a TrainingSpec as stored (kiln.control.parts.layout_of_stored)."""
    return layout_of_stored(body).job_names(body["metadata"]["name"])




def resolve(doc: TrainingSpec, config: OperatorConfig) -> TrainingSpec:
    """The spec with every default made explicit: what the pods run with (and what `kiln render` shows)."""
    s = doc.spec
    # model.from: the dimensions are in the folder's config.json, which the trainer reads (kiln.trainer.model.hf_folder)
    model = s.model if s.model.from_ else s.model.model_copy(update=resolved_model_fields(s.model))
    lo, hi = node_bounds(s)
    uri = s.checkpoint.uri or f"file://{config.scratch_dir}/checkpoints/"
    spec = s.model_copy(update={
        "image": s.image or config.image,
        "model": model,
        "resources": s.resources.model_copy(update={"processes_per_node": processes_per_node(s)}),
        "elastic": s.elastic.model_copy(update={"min_nodes": lo, "max_nodes": hi}),
        "checkpoint": s.checkpoint.model_copy(update={"uri": uri}),
    }, deep=True)
    meta = {"name": doc.metadata.name}
    if doc.metadata.namespace:
        meta["namespace"] = doc.metadata.namespace
    return TrainingSpec.model_validate({"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
                                        "spec": spec.model_dump(by_alias=True, exclude_none=True)})


def resolved_model_fields(model) -> dict:
    """The preset's dimensions as spec fields. Of the MoE shape only what `model.moe` can say: the rest (Qwen's
    shared gate, its dense layers) comes with the preset, which the resolved spec keeps."""
    dims = resolve_model(model).model_dump()
    if dims.get("moe") is not None:
        dims["moe"] = MoESpec.model_validate({k: v for k, v in dims["moe"].items() if k in MoESpec.model_fields})
    return dims


def dump(doc: TrainingSpec) -> dict:
    return doc.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})


def immutable_changes(applied: dict, resolved: dict) -> list[str]:
    """'spec.<path> (old → new)' for every leaf of IMMUTABLE_WHILE_RUNNING that differs."""
    changed: list[str] = []

    def diff(path: str, old: Any, new: Any) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for key in dict.fromkeys([*old, *new]):
                diff(f"{path}.{key}", old.get(key), new.get(key))
        elif old != new:
            changed.append(f"{path} ({json.dumps(old)} → {json.dumps(new)})")

    for path in IMMUTABLE_WHILE_RUNNING:
        old, new = applied.get("spec", {}), resolved.get("spec", {})
        for key in path:
            old, new = (old or {}).get(key), (new or {}).get(key)
        diff("spec." + ".".join(path), old, new)
    return changed


def plan(doc: TrainingSpec, observed: Observed | None = None, config: OperatorConfig | None = None) -> Plan:
    """The desired objects for one TrainingSpec (metadata needs name, namespace and, in a cluster, uid)."""
    observed = observed or Observed()
    config = config or OperatorConfig()
    problems = check(doc.spec, scope="all")
    if problems:  # the apiserver's CEL refuses these too; reached by `kiln render` or a CRD without rules
        raise KilnError("\n".join(problems))
    forbidden = violations(doc.spec, config.policy, config.image)
    if forbidden:
        return Plan(refused="; ".join(forbidden), refused_reason="ForbiddenByPolicy")
    left_out, uncovered = queue_fit(doc.spec, config, observed)
    if uncovered:  # refused whole: a job Kueue can never admit would sit Queued for ever
        return Plan(refused="; ".join(uncovered), refused_reason="NotCoveredByQueue")
    notes = [f"the pods do not request {r} (kiln's default; ClusterQueue {observed.queue_coverage.cluster_queue} "
             f"does not cover it){LEFT_OUT_WHY.get(r, '')}" for r in left_out if observed.queue_coverage]
    level, needs = pods.security_level(doc.spec)
    if level != "restricted":  # allowed by the admin policy (checked above); the namespace must allow it too
        notes.append(f"the pods need Pod Security level {level} ({pods.LEVEL_LABEL}: {level} on the namespace): "
                     + ", ".join(needs))
    resolved = resolve(doc, config)
    resolved_dict = dump(resolved)
    if observed.applied is not None and observed.job_active:
        changed = immutable_changes(observed.applied, resolved_dict)
        if changed:
            return Plan(refused="the running job cannot absorb a change of " + ", ".join(changed)
                        + "; revert it, or delete the TrainingSpec and create a new run")
    meta = doc.metadata
    extra = meta.model_extra or {}
    owner = None
    if extra.get("uid"):
        owner = {"apiVersion": API_VERSION, "kind": KIND, "name": meta.name, "uid": extra["uid"],
                 "controller": True, "blockOwnerDeletion": True}
    n = names(meta.name)

    def metadata(name: str, labels: dict | None = None) -> dict:
        m: dict[str, Any] = {"name": name, "labels": {**MANAGED_BY, RUN_LABEL: meta.name, **(labels or {})}}
        if meta.namespace:
            m["namespace"] = meta.namespace
        if owner:
            m["ownerReferences"] = [owner]
        return m

    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(n["configmap"]),
                 "data": {SPEC_FILE: yaml.dump(resolved_dict, Dumper=SafeDumper, sort_keys=False)}}
    return Plan(objects=[*trainer_identity(meta.name, metadata, doc.spec.pod.service_account_name),
                         trainer_network_policy(meta.name, metadata, config),
                         configmap, *layout_of(resolved.spec).objects(resolved, observed, config, metadata)],
                notes=notes)












