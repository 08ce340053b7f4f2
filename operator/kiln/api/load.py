"""Reading TrainingSpec documents from YAML, with errors that name the file and the field path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kiln.api.rules import check
from kiln.api.spec import API_VERSION, KIND, TrainingSpec
from kiln.errors import KilnError


def format_validation_error(err: ValidationError, source: str = "") -> str:
    """One line per problem: '<source>: <field path>: <what is wrong / what is valid>'."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error" and msg.startswith(("spec.", "metadata.")):
            # cross-field rules (kiln.api.rules) carry their own paths, one per line
            lines.extend(f"{source}{part}" for part in msg.splitlines())
            continue
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; `kiln crd` shows every field)"
        elif e["type"] in ("literal_error", "enum"):
            msg = f"{msg}, got {e.get('input')!r}"
        lines.append(f"{source}{loc}: {msg}")
    return "\n".join(lines)


def parse(doc: Any, source: str = "", scope: str = "local") -> TrainingSpec:
    """A TrainingSpec from a parsed YAML/JSON document; KilnError naming the field when it is invalid.

    scope "local": the rules for any run (kiln run); "all": also those for Kubernetes (kiln validate).
    """
    prefix = f"{source}: " if source else ""
    if not isinstance(doc, dict):
        raise KilnError(f"{prefix}expected a TrainingSpec mapping (apiVersion: {API_VERSION}, kind: {KIND}), "
                        f"got {type(doc).__name__}")
    if doc.get("kind", KIND) != KIND or doc.get("apiVersion", API_VERSION) != API_VERSION:
        raise KilnError(f"{prefix}expected apiVersion: {API_VERSION} and kind: {KIND}, "
                        f"got apiVersion: {doc.get('apiVersion')}, kind: {doc.get('kind')}")
    try:
        return TrainingSpec.model_validate(doc, context={"rules": scope})
    except ValidationError as err:
        raise KilnError(format_validation_error(err, prefix)) from None


def load_documents(path: str | Path) -> list[Any]:
    """Every YAML document of a file (empty documents skipped); KilnError for a missing or broken file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise KilnError(f"{p}: cannot read ({err.strerror})") from None
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise KilnError(f"{p}: not valid YAML: {err}") from None


def load_file(path: str | Path, scope: str = "local") -> list[TrainingSpec]:
    """Every TrainingSpec in a YAML file, validated by the rules of `scope` (see parse)."""
    docs = load_documents(path)
    if not docs:
        raise KilnError(f"{path}: no TrainingSpec in the file")
    return [parse(d, f"{path}" + (f"[{i}]" if len(docs) > 1 else ""), scope) for i, d in enumerate(docs)]


def check_cluster(spec: TrainingSpec, source: str = "") -> None:
    """The rules that apply only on Kubernetes (the apiserver enforces them too)."""
    problems = check(spec.spec, scope="all")
    if problems:
        prefix = f"{source}: " if source else ""
        raise KilnError("\n".join(prefix + p for p in problems))


def dump_for_apply(doc: TrainingSpec) -> dict:
    """The document as the user wrote it (unset fields left out), for server-side apply."""
    body = doc.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude={"status"})
    body["apiVersion"], body["kind"] = API_VERSION, KIND
    meta = {"name": doc.metadata.name}
    if doc.metadata.namespace:
        meta["namespace"] = doc.metadata.namespace
    for key in ("labels", "annotations"):
        if (doc.metadata.model_extra or {}).get(key):
            meta[key] = doc.metadata.model_extra[key]
    body["metadata"] = meta
    return body
