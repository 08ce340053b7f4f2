"""The base every API model derives from, and the value patterns several API modules share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# A Kubernetes resource quantity as people write them: 32, 500m, 1.5, 512Gi, 100G (no exponents, no signs)
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"


class ApiModel(BaseModel):
    """Base for every API object: camelCase aliases, unknown fields rejected, Python names accepted too."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        allow_inf_nan=False,  # YAML has .inf and .nan, JSON (what the apiserver stores) has neither
    )


def with_cel(*rules: tuple[str, str]) -> ConfigDict:
    """ApiModel's config plus CEL rules (rule, message) on the model's object in the CRD: the same rule as the
    model's Python validator, for the apiserver (kiln.api.crd keeps json_schema_extra)."""
    return ConfigDict(**ApiModel.model_config, json_schema_extra={
        "x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in rules]})


def one_of_cel(fields: tuple[str, ...]) -> str:
    """CEL: exactly one of these (camelCase) fields is set."""
    return "[" + ", ".join(f"has(self.{f})" for f in fields) + "].filter(x, x).size() == 1"


def exactly_one(model: BaseModel, fields: tuple[str, ...], what: str) -> None:
    """Python for one_of_cel: ValueError naming the fields when not exactly one of them is set."""
    set_ = [f for f in fields if getattr(model, _snake(f)) is not None]
    if len(set_) != 1:
        raise ValueError(f"{what} sets exactly one of {', '.join(fields)} (got {', '.join(set_) or 'none'})")


def _snake(camel: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in camel)
