"""The cluster admin's limits on what a namespace user may put into trainer pods. Pure.

A TrainingSpec is written by whoever may create one in a namespace; the operator turns it into pods with
the operator's own rights. Without limits that user picks any image, tolerates every taint (`operator:
Exists` with no key), selects control-plane nodes, or takes a `system-*` PriorityClass and preempts the
cluster's own components. The admin sets these limits in the chart (values `policy.*`, env KILN_POLICY_*);
a spec that breaks one is refused with the condition SpecAccepted=False, reason ForbiddenByPolicy, naming
the field — nothing is applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


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

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "AdminPolicy":
        """KILN_POLICY_IMAGE_PREFIXES, KILN_POLICY_PRIORITY_CLASSES, KILN_POLICY_FORBIDDEN_NODE_KEYS (comma
        separated; the last replaces the control-plane default when set) and KILN_POLICY_ALLOW_TOLERATE_ALL."""
        def items(var: str) -> tuple[str, ...] | None:
            raw = env.get(var)
            return None if raw is None else tuple(x.strip() for x in raw.split(",") if x.strip())

        kwargs: dict[str, Any] = {}
        for field, var in (("allowed_image_prefixes", "KILN_POLICY_IMAGE_PREFIXES"),
                           ("allowed_priority_classes", "KILN_POLICY_PRIORITY_CLASSES"),
                           ("forbidden_node_keys", "KILN_POLICY_FORBIDDEN_NODE_KEYS")):
            if (value := items(var)) is not None:
                kwargs[field] = value
        if env.get("KILN_POLICY_ALLOW_TOLERATE_ALL"):
            kwargs["allow_tolerate_all"] = env["KILN_POLICY_ALLOW_TOLERATE_ALL"].strip().lower() in ("1", "true", "yes")
        return cls(**kwargs)


def violations(spec: Any, policy: AdminPolicy, default_image: str) -> list[str]:
    """What in `spec` (a TrainingSpecSpec) the policy forbids, one line per field; empty when allowed."""
    out = []
    image = spec.image
    if image and image != default_image and policy.allowed_image_prefixes \
            and not image.startswith(policy.allowed_image_prefixes):
        out.append(f"spec.image: {image!r} is not allowed here; images must start with "
                   f"{' or '.join(repr(p) for p in policy.allowed_image_prefixes)} (or leave spec.image unset)")
    priority = spec.scheduling.priority_class_name
    if priority:
        if policy.allowed_priority_classes and priority not in policy.allowed_priority_classes:
            out.append(f"spec.scheduling.priorityClassName: {priority!r} is not allowed here; allowed: "
                       f"{', '.join(policy.allowed_priority_classes)}")
        elif not policy.allowed_priority_classes and priority.startswith("system-"):
            out.append(f"spec.scheduling.priorityClassName: {priority!r} is reserved for the cluster's own components")
    r = spec.resources
    forbidden = set(policy.forbidden_node_keys)
    for key in sorted(forbidden & set(r.node_selector)):
        out.append(f"spec.resources.nodeSelector: {key!r} selects nodes kiln's pods may not run on")
    for key in sorted(forbidden & _affinity_keys(r.affinity)):
        out.append(f"spec.resources.affinity: {key!r} selects nodes kiln's pods may not run on")
    for i, t in enumerate(r.tolerations):
        if t.key in forbidden:
            out.append(f"spec.resources.tolerations[{i}]: tolerating {t.key!r} would place pods on nodes kiln's "
                       "pods may not run on")
        elif not t.key and t.operator == "Exists" and not policy.allow_tolerate_all:
            out.append(f"spec.resources.tolerations[{i}]: operator Exists without a key tolerates every taint; "
                       "name the taint's key")
    return out


def _affinity_keys(affinity: Any) -> set[str]:
    """Node label keys that a core/v1 Affinity's nodeAffinity asks for (In, Exists, Gt, Lt; NotIn and
    DoesNotExist keep pods away from such nodes, which is always allowed). The affinity is passed through as
    the user wrote it: a malformed one yields what it can, and the apiserver refuses the rest at apply."""
    def obj(x: Any) -> dict:
        return x if isinstance(x, dict) else {}

    def items(x: Any) -> list:
        return x if isinstance(x, list) else []

    node = obj(obj(affinity).get("nodeAffinity"))
    terms = items(obj(node.get("requiredDuringSchedulingIgnoredDuringExecution")).get("nodeSelectorTerms"))
    terms += [obj(p).get("preference") for p in items(node.get("preferredDuringSchedulingIgnoredDuringExecution"))]
    keys = set()
    for term in terms:
        for expr in map(obj, items(obj(term).get("matchExpressions"))):
            if expr.get("operator") not in ("NotIn", "DoesNotExist") and isinstance(expr.get("key"), str):
                keys.add(expr["key"])
    return keys
