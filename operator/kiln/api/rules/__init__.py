"""Cross-field rules of the TrainingSpec, written once and enforced twice.

Each `Rule` carries a CEL expression (the CRD generator puts it into `x-kubernetes-validations` of
`spec`, so the apiserver refuses the spec) and a Python check (run by pydantic, so `kiln validate`
and `kiln run` refuse the same spec). Both report the same field path and the same message, which
says what would be valid; the Python side adds the offending values.

CEL sees the spec after the apiserver applied the CRD defaults, so fields with a default are always
present; optional fields (no default) are guarded with has(). The helpers in `common` spell the derived
values (effective processes per node, model dims from a preset) once for each language. The Python side of
the layout rules (which worlds a spec runs at) is kiln.api.layout's, which the operator and trainer call too.

One module per topic, each with its list of rules: `model` (spec.model), `layout` (the parallel layout's
CEL and the schedule's shape), `placement` (GPUs, topology, node bounds, plan, replica groups), `stores`
(checkpoint and data locations, formats); `common` holds the `Rule` record and the derived values they
share. RULES joins them in the CRD's order; the document-level name rule and `check` live here.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from kiln.api.rules.common import Rule, Scope, shown
from kiln.api.rules.layout import SHAPE_RULES
from kiln.api.rules.model import MODEL_RULES
from kiln.api.rules.placement import PLACEMENT_RULES
from kiln.api.rules.stores import STORE_RULES

if TYPE_CHECKING:
    from kiln.api.spec import TrainingSpecSpec

__all__ = ["NAME_CEL", "NAME_MAX", "NAME_MESSAGE", "NAME_PATTERN", "RULES", "Rule", "Scope", "check", "check_name",
           "shown"]

# the order is the CRD's x-kubernetes-validations order and the order problems are reported in
RULES: list[Rule] = [*MODEL_RULES, *SHAPE_RULES, *PLACEMENT_RULES, *STORE_RULES]

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
