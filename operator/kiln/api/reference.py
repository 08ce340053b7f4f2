"""The field reference of docs/api.md, generated from the models and rules (a test keeps them in step)."""

from __future__ import annotations

from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from kiln.api.rules import NAME_MESSAGE, RULES
from kiln.api.spec import INT32_MAX, JSON_INT_MAX, JSON_INT_MIN, TrainingSpecSpec, TrainingSpecStatus

BEGIN, END = "<!-- BEGIN GENERATED: kiln.api.reference -->", "<!-- END GENERATED -->"


def _model_of(tp: Any) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in get_args(tp):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Annotated:
        return _type_name(get_args(tp)[0])
    if origin is not None and str(origin).endswith("Literal"):
        return " \\| ".join(f"`{a}`" for a in get_args(tp))
    args = [a for a in get_args(tp) if a is not type(None)]
    if origin in (list,):
        return f"list of {_type_name(args[0])}"
    if origin in (dict,):
        return "map"
    if args and origin is not None:
        return " \\| ".join(_type_name(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "object"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp, getattr(tp, "__name__", str(tp)))


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            value = value.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
        return f"`{value}`" if value not in ({}, []) else ""
    if field.default is PydanticUndefined:
        return "required"
    if isinstance(field.default, bool):
        return f"`{str(field.default).lower()}`"
    return "" if field.default in (None, "") else f"`{field.default}`"


def _bounds(field) -> str:
    """' ≥ 1 (int32)', ' > 0', ' ≥ 0, ≤ 1': the field's bounds, as the CRD's minimum/maximum carry them."""
    found = {op: getattr(m, op) for m in field.metadata for op in ("ge", "gt", "le", "lt")
             if getattr(m, op, None) is not None}
    width = {INT32_MAX: "int32", JSON_INT_MAX: "±2⁵³−1"}.get(found.get("le"))
    parts = [f"{sign} {found[op]}" for op, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
             if op in found and not (op == "ge" and found[op] == JSON_INT_MIN) and not (op == "le" and width)]
    return (" " + ", ".join(parts) if parts else "") + (f" ({width})" if width else "")


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{field.alias or name}"
        rows.append(f"| `{path}` | {_type_name(field.annotation)}{_bounds(field)} | {_default(field)} | "
                    f"{(field.description or '').replace('|', '/')} |")
        sub = _model_of(field.annotation)
        if sub is not None:
            rows.extend(_rows(sub, path))
    return rows


def reference_markdown() -> str:
    head = "| field | type | default | meaning |\n|---|---|---|---|"
    rules = "\n".join(f"| `{r.path}` | {r.message} | {'Kubernetes only' if r.scope == 'cluster' else 'everywhere'} |"
                      for r in RULES)
    return "\n".join([
        BEGIN,
        "### spec", head, *_rows(TrainingSpecSpec, "spec"), "",
        "### status", head, *_rows(TrainingSpecStatus, "status"), "",
        "### Cross-field rules",
        "| field | rule | where |\n|---|---|---|",
        rules,
        f"| `metadata.name` | {NAME_MESSAGE} | everywhere |",
        END,
    ])
