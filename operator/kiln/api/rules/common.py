"""What every rule module shares: the `Rule` record, the derived values each rule reads (in Python and in
CEL, spelled once for each language) and `shown`, which quotes input in errors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from kiln.api.presets import PRESETS

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
FT_ON = ("(has(self.elastic.faultTolerance) && self.elastic.faultTolerance.mode == 'replicaGroups' && "
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


def shown(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: errors quote the input, but never megabytes of it."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def check_store_uri(uri: str | None) -> str | None:
    if uri is not None and not uri.startswith(("s3://", "file://")):
        return f"got {shown(uri)}"
    return None
