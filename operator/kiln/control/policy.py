"""The cluster admin's limits on what a namespace user may put into trainer pods. Pure.

A TrainingSpec is written by whoever may create one in a namespace; the operator turns it into pods with
the operator's own rights. Without limits that user picks any image, tolerates every taint (`operator:
Exists` with no key), selects control-plane nodes, or takes a `system-*` PriorityClass and preempts the
cluster's own components. The admin sets these limits in the chart (values `policy.*`, env KILN_POLICY_*);
a spec that breaks one is refused with the condition SpecAccepted=False, reason ForbiddenByPolicy, naming
the field — nothing is applied. The size caps also bound the operator's own work: one spec's fan-out (pods,
PyTorchJobs) is what every resync renders again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kiln.api.layout import node_bounds, replica_groups
from kiln.errors import KilnError
from kiln.control.network import preset  # a preset's devices and capabilities are judged as the user's own

CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
# The taint `kubectl cordon` sets: the cluster's own "no new pods here" (drains, repairs), never a tenant's to lift
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
# Ways to pick nodes by name: a name reaches any node, the fenced ones included, and a policy of labels cannot
# see which node a name will be (it may not exist yet)
HOSTNAME_LABEL = "kubernetes.io/hostname"
NODE_NAME_FIELD = "metadata.name"


@dataclass(frozen=True)
class AdminPolicy:
    # spec.image must start with one of these (the operator's own trainer image always may run); empty: any
    allowed_image_prefixes: tuple[str, ...] = ()
    # scheduling.priorityClassName must be one of these; empty: any that does not start with "system-"
    allowed_priority_classes: tuple[str, ...] = ()
    # node labels a spec may not select (nodeSelector, or required/preferred node affinity), nor tolerate as taints
    forbidden_node_keys: tuple[str, ...] = CONTROL_PLANE_KEYS
    # a toleration with no key and operator Exists tolerates every taint, the admin's fences included
    allow_tolerate_all: bool = False
    # scheduling.priority (Kueue WorkloadPriorityClass: order in the queue, whom it preempts) must be one of
    # these; empty: any
    allowed_queue_priorities: tuple[str, ...] = ()
    # nodes picked by name (kubernetes.io/hostname In, matchFields metadata.name In); kiln's own avoidance of
    # failed nodes (NotIn) is never affected
    allow_node_names: bool = False
    # size caps per run, 0: none. Nodes and GPUs count the most the run may grow to (elastic.maxNodes).
    max_nodes: int = 0
    max_gpus: int = 0
    max_groups: int = 0
    # spec.pod (and spec.network's presets): what lets a pod reach beyond its container (kiln.control.pods).
    # hostPath volumes only under these folders (a prefix matches at a path boundary); empty: none
    allowed_host_path_prefixes: tuple[str, ...] = ()
    # capabilities a pod may add (pod.capabilities, a preset's IPC_LOCK); empty: none
    allowed_capabilities: tuple[str, ...] = ()
    allow_host_network: bool = False
    allow_host_ipc: bool = False
    # extended resources a pod may request (pod.extraResources, a preset's devices): exact names, or a domain
    # ending in '/' (rdma/ allows every rdma/* resource); empty: none
    allowed_extra_resources: tuple[str, ...] = ()
    # pod.serviceAccountName must be one of these; empty: any in the run's namespace
    allowed_service_accounts: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "AdminPolicy":
        """KILN_POLICY_IMAGE_PREFIXES, KILN_POLICY_PRIORITY_CLASSES, KILN_POLICY_QUEUE_PRIORITIES,
        KILN_POLICY_FORBIDDEN_NODE_KEYS (comma separated; the last replaces the control-plane default when set),
        KILN_POLICY_ALLOW_TOLERATE_ALL, KILN_POLICY_ALLOW_NODE_NAMES and KILN_POLICY_MAX_NODES / _MAX_GPUS /
        _MAX_GROUPS (0 or unset: no cap)."""
        def items(var: str) -> tuple[str, ...] | None:
            raw = env.get(var)
            return None if raw is None else tuple(x.strip() for x in raw.split(",") if x.strip())

        kwargs: dict[str, Any] = {}
        for field, var in (("allowed_image_prefixes", "KILN_POLICY_IMAGE_PREFIXES"),
                           ("allowed_priority_classes", "KILN_POLICY_PRIORITY_CLASSES"),
                           ("allowed_queue_priorities", "KILN_POLICY_QUEUE_PRIORITIES"),
                           ("forbidden_node_keys", "KILN_POLICY_FORBIDDEN_NODE_KEYS"),
                           *POD_LISTS):
            if (value := items(var)) is not None:
                kwargs[field] = value
        for field, var in (("allow_tolerate_all", "KILN_POLICY_ALLOW_TOLERATE_ALL"),
                           ("allow_node_names", "KILN_POLICY_ALLOW_NODE_NAMES"), *POD_SWITCHES):
            if env.get(var):
                kwargs[field] = env[var].strip().lower() in ("1", "true", "yes")
        for field, var in (("max_nodes", "KILN_POLICY_MAX_NODES"), ("max_gpus", "KILN_POLICY_MAX_GPUS"),
                           ("max_groups", "KILN_POLICY_MAX_GROUPS")):
            if (raw := env.get(var, "").strip()):
                if not raw.isdigit():
                    raise KilnError(f"{var}={raw!r}: a cap is a whole number (0: no cap)")
                kwargs[field] = int(raw)
        return cls(**kwargs)


# spec.pod's limits and their env variables (the chart's values policy.* set them)
POD_LISTS = (("allowed_host_path_prefixes", "KILN_POLICY_HOST_PATH_PREFIXES"),
             ("allowed_capabilities", "KILN_POLICY_CAPABILITIES"),
             ("allowed_extra_resources", "KILN_POLICY_EXTRA_RESOURCES"),
             ("allowed_service_accounts", "KILN_POLICY_SERVICE_ACCOUNTS"))
POD_SWITCHES = (("allow_host_network", "KILN_POLICY_ALLOW_HOST_NETWORK"), ("allow_host_ipc", "KILN_POLICY_ALLOW_HOST_IPC"))


def violations(spec: Any, policy: AdminPolicy, default_image: str) -> list[str]:
    """What in `spec` (a TrainingSpecSpec) the policy forbids, one line per field; empty when allowed."""
    out = []
    image = spec.image
    if image and image != default_image and policy.allowed_image_prefixes \
            and not any(image_allowed(image, rule) for rule in policy.allowed_image_prefixes):
        out.append(f"spec.image: {image!r} is not allowed here; images must be under "
                   f"{' or '.join(repr(p) for p in policy.allowed_image_prefixes)} (or leave spec.image unset)")
    priority = spec.scheduling.priority_class_name
    if priority:
        if policy.allowed_priority_classes and priority not in policy.allowed_priority_classes:
            out.append(f"spec.scheduling.priorityClassName: {priority!r} is not allowed here; allowed: "
                       f"{', '.join(policy.allowed_priority_classes)}")
        elif not policy.allowed_priority_classes and priority.startswith("system-"):
            out.append(f"spec.scheduling.priorityClassName: {priority!r} is reserved for the cluster's own components")
    queue_priority = spec.scheduling.priority
    if queue_priority and policy.allowed_queue_priorities and queue_priority not in policy.allowed_queue_priorities:
        out.append(f"spec.scheduling.priority: {queue_priority!r} is not allowed here; allowed: "
                   f"{', '.join(policy.allowed_queue_priorities)}")
    out += _size_violations(spec, policy)
    out += _node_violations(spec.resources, policy)
    out += pod_violations(spec, policy)
    return out


def _size_violations(spec: Any, policy: AdminPolicy) -> list[str]:
    r = spec.resources
    nodes = max(r.nodes, node_bounds(spec)[1], *(p.nodes for p in spec.elastic.plan or ()))
    groups = replica_groups(spec)
    out = []
    if policy.max_nodes and nodes > policy.max_nodes:
        field = "resources.nodes" if nodes == r.nodes else "elastic.maxNodes"
        out.append(f"spec.{field}: {nodes} nodes is more than this cluster allows per run ({policy.max_nodes})")
    if policy.max_gpus and nodes * r.gpus_per_node > policy.max_gpus:
        out.append(f"spec.resources.gpusPerNode: {nodes} node(s) x {r.gpus_per_node} GPUs = {nodes * r.gpus_per_node} "
                   f"GPUs is more than this cluster allows per run ({policy.max_gpus})")
    if policy.max_groups and groups > policy.max_groups:
        out.append(f"spec.elastic.faultTolerance.groups: {groups} replica groups is more than this cluster allows "
                   f"per run ({policy.max_groups})")
    return out


def _node_violations(r: Any, policy: AdminPolicy) -> list[str]:
    out = []
    forbidden = set(policy.forbidden_node_keys)
    for key in sorted(forbidden & set(r.node_selector)):
        out.append(f"spec.resources.nodeSelector: {key!r} selects nodes kiln's pods may not run on")
    node_terms = _node_terms(r.affinity)
    for key in sorted(forbidden & _affinity_keys(node_terms)):
        out.append(f"spec.resources.affinity: {key!r} selects nodes kiln's pods may not run on")
    if not policy.allow_node_names:
        if HOSTNAME_LABEL in r.node_selector:
            out.append(f"spec.resources.nodeSelector: {HOSTNAME_LABEL!r} picks a node by name, which reaches nodes "
                       "kiln's pods may not run on; select by a label of the node pool")
        if _names_nodes(node_terms):
            out.append(f"spec.resources.affinity: picking nodes by name ({HOSTNAME_LABEL} or matchFields "
                       f"{NODE_NAME_FIELD} with In) reaches nodes kiln's pods may not run on; select by a label")
    for kind, path in _other_namespace_terms(r.affinity):
        out.append(f"spec.resources.affinity.{kind}.{path}: namespaces / namespaceSelector reach other namespaces' "
                   "pods; leave both unset (the run's own namespace)")
    for i, t in enumerate(r.tolerations):
        if t.key in forbidden:
            out.append(f"spec.resources.tolerations[{i}]: tolerating {t.key!r} would place pods on nodes kiln's "
                       "pods may not run on")
        elif t.key == UNSCHEDULABLE_TAINT and not policy.allow_tolerate_all:
            out.append(f"spec.resources.tolerations[{i}]: tolerating {t.key!r} would place pods on cordoned nodes")
        elif not t.key and t.operator == "Exists" and not policy.allow_tolerate_all:
            out.append(f"spec.resources.tolerations[{i}]: operator Exists without a key tolerates every taint; "
                       "name the taint's key")
    return out


def under(path: str, prefix: str) -> bool:
    """Whether `path` is `prefix` or inside it (/data allows /data and /data/x, never /data2)."""
    prefix = prefix.rstrip("/")
    return path.rstrip("/") == prefix or path.startswith(prefix + "/")


def resource_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    return any(name == a or (a.endswith("/") and name.startswith(a)) for a in allowed)


def pod_violations(spec: Any, policy: AdminPolicy) -> list[str]:
    """spec.pod and the network preset's requests against the policy, one line per field."""
    pod, net, out = spec.pod, preset(spec.network), []
    allowed = " or ".join(repr(p) for p in policy.allowed_host_path_prefixes) or "none (policy.hostPathPrefixes)"
    for i, v in enumerate(pod.volumes):
        if v.host_path and not any(under(v.host_path.path, p) for p in policy.allowed_host_path_prefixes):
            out.append(f"spec.pod.volumes[{i}].hostPath.path: {v.host_path.path!r} is not under a folder the admin "
                       f"allows; allowed: {allowed}")
    caps = [(f"spec.pod.capabilities[{i}]", c) for i, c in enumerate(pod.capabilities)]
    caps += [(f"spec.network.fabric ({spec.network.fabric} needs it)", c) for c in net.capabilities
             if c not in pod.capabilities]
    for where, cap in caps:
        if cap not in policy.allowed_capabilities:
            out.append(f"{where}: capability {cap} is not allowed here; allowed: "
                       f"{', '.join(policy.allowed_capabilities) or 'none (policy.capabilities)'}")
    for flag, field, name in ((pod.host_network, "allow_host_network", "hostNetwork"),
                              (pod.host_ipc, "allow_host_ipc", "hostIPC")):
        if flag and not getattr(policy, field):
            out.append(f"spec.pod.{name}: the node's {name[4:].lower()} namespace is not allowed here "
                       f"(policy.allow{name[0].upper()}{name[1:]})")
    wanted = [(f"spec.pod.extraResources[{i}]", r.name) for i, r in enumerate(pod.extra_resources)]
    wanted += [(f"spec.network.fabric ({spec.network.fabric} requests it)", n) for n in net.resources]
    for where, name in wanted:
        if not resource_allowed(name, policy.allowed_extra_resources):
            out.append(f"{where}: resource {name} is not allowed here; allowed: "
                       f"{', '.join(policy.allowed_extra_resources) or 'none (policy.extraResources)'}")
    sa = pod.service_account_name
    if sa and policy.allowed_service_accounts and sa not in policy.allowed_service_accounts:
        out.append(f"spec.pod.serviceAccountName: {sa!r} is not allowed here; allowed: "
                   f"{', '.join(policy.allowed_service_accounts)}")
    return out


# ---- image references -----------------------------------------------------------------------------------------

# distribution/reference: [host[:port]/]path[:tag][@algorithm:hex]. The first component is a registry host when
# it has a "." or ":" or is "localhost"; otherwise the reference is Docker Hub's (docker.io, "library/" for
# one-component names), as every container runtime resolves it.
_DIGEST = re.compile(r"@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,}$")
_TAG = re.compile(r":[\w][\w.-]{0,127}$")


def _is_host(component: str) -> bool:
    return "." in component or ":" in component or component == "localhost"


def parse_image(ref: str) -> tuple[str, str | None, str | None]:
    """(repository with its registry, tag or None, digest or None) of an image reference, Docker Hub names
    spelled out (`ubuntu` -> `docker.io/library/ubuntu`)."""
    digest = None
    if (m := _DIGEST.search(ref)):
        ref, digest = ref[:m.start()], m.group()[1:].lower()
    tag = None
    if (m := _TAG.search(ref)):
        ref, tag = ref[:m.start()], m.group()[1:]
    first, _, rest = ref.partition("/")
    if not rest or not _is_host(first):
        ref = "docker.io/" + (ref if rest else "library/" + ref)
    return ref, tag, digest


def image_allowed(image: str, rule: str) -> bool:
    """Whether `image` is under the allow-list entry `rule`, at registry and repository boundaries: a rule
    `registry.corp/ml` (or `registry.corp/ml/`) admits `registry.corp/ml/trainer:1` but neither
    `registry.corp/ml-evil/x` nor `registry.corp.attacker.io/ml/x`; a rule with a tag or digest admits that
    exact image only (`ghcr.io/org/kiln-trainer@sha256:...` pins the bytes). A rule without "/" that has a "."
    or ":" (or is `localhost`) is a registry host."""
    rule = rule.rstrip("/")
    if not rule:
        return False
    repo, tag, digest = parse_image(image)
    if "/" not in rule and _is_host(rule):  # a registry: anything it serves
        return repo.startswith(rule + "/")
    rule_repo, rule_tag, rule_digest = parse_image(rule)
    if rule_digest:
        return repo == rule_repo and digest == rule_digest
    if rule_tag:
        return repo == rule_repo and tag == rule_tag
    return repo == rule_repo or repo.startswith(rule_repo + "/")


# ---- affinity, as the user wrote it ------------------------------------------------------------------------
# The affinity is passed through unchanged: a malformed one yields what it can here, and the apiserver refuses
# the rest at apply.


def _obj(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _items(x: Any) -> list:
    return x if isinstance(x, list) else []


def _node_terms(affinity: Any) -> list[dict]:
    """The nodeSelectorTerms (required) and preferences (preferred) of a core/v1 Affinity's nodeAffinity."""
    node = _obj(_obj(affinity).get("nodeAffinity"))
    terms = _items(_obj(node.get("requiredDuringSchedulingIgnoredDuringExecution")).get("nodeSelectorTerms"))
    terms = terms + [_obj(p).get("preference") for p in _items(node.get("preferredDuringSchedulingIgnoredDuringExecution"))]
    return [_obj(t) for t in terms]


def _affinity_keys(terms: list[dict]) -> set[str]:
    """Node label keys the terms ask for (In, Exists, Gt, Lt; NotIn and DoesNotExist keep pods away from such
    nodes, which is always allowed)."""
    keys = set()
    for term in terms:
        for expr in map(_obj, _items(term.get("matchExpressions"))):
            if expr.get("operator") not in ("NotIn", "DoesNotExist") and isinstance(expr.get("key"), str):
                keys.add(expr["key"])
    return keys


def _names_nodes(terms: list[dict]) -> bool:
    """Whether a term picks nodes by name: kubernetes.io/hostname In, or matchFields metadata.name In."""
    for term in terms:
        picks = [e for e in map(_obj, _items(term.get("matchExpressions"))) if e.get("key") == HOSTNAME_LABEL]
        picks += [e for e in map(_obj, _items(term.get("matchFields"))) if e.get("key") == NODE_NAME_FIELD]
        if any(e.get("operator") == "In" for e in picks):
            return True
    return False


def _other_namespace_terms(affinity: Any) -> list[tuple[str, str]]:
    """(podAffinity | podAntiAffinity, path of the term) for each pod (anti-)affinity term that names other
    namespaces: `namespaces` or `namespaceSelector` (an empty selector is every namespace). Without them a term
    means the pod's own namespace, the run's."""
    out = []
    for kind in ("podAffinity", "podAntiAffinity"):
        pod = _obj(_obj(affinity).get(kind))
        terms = [(f"requiredDuringSchedulingIgnoredDuringExecution[{i}]", _obj(t))
                 for i, t in enumerate(_items(pod.get("requiredDuringSchedulingIgnoredDuringExecution")))]
        terms += [(f"preferredDuringSchedulingIgnoredDuringExecution[{i}].podAffinityTerm", _obj(_obj(t).get("podAffinityTerm")))
                  for i, t in enumerate(_items(pod.get("preferredDuringSchedulingIgnoredDuringExecution")))]
        out += [(kind, path) for path, term in terms if term.get("namespaces") or term.get("namespaceSelector") is not None]
    return out
