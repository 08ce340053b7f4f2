"""Reading TrainingSpec documents from YAML, with errors that name the file and the field path."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kiln.api.rules import check, shown
from kiln.api.spec import API_VERSION, KIND, TrainingSpec
from kiln.errors import KilnError

# Bounds on what one file may cost to read, so that hostile or careless input answers fast and briefly:
MAX_FILE_BYTES = 3 << 20  # the apiserver refuses request bodies over 3 MiB; a TrainingSpec is a few KiB
MAX_NODES = 10_000  # YAML nodes of all documents, aliases expanded (a TrainingSpec has a few hundred)
MAX_DEPTH = 64  # nesting, aliases expanded (a TrainingSpec with an affinity nests about 12 deep)
MAX_DOCUMENTS = 256
MAX_INT_DIGITS = 40  # far beyond int64 (19 digits); Python's int() refuses 4300+ digits with a ValueError
MAX_ERROR_LINES = 40  # problems listed per document
MAX_LINE = 400  # characters per error line


def format_validation_error(err: ValidationError, source: str = "") -> str:
    """One line per problem: '<source>: <field path>: <what is wrong / what is valid>'."""
    lines = []
    for e in err.errors():
        loc = ".".join(shown(p, 60) if not isinstance(p, (str, int)) or len(str(p)) > 60 else str(p)
                       for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error" and msg.startswith(("spec.", "metadata.")):
            # cross-field rules (kiln.api.rules) carry their own paths, one per line
            lines.extend(f"{source}{part}" for part in msg.splitlines())
            continue
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; `kiln crd` shows every field)"
        elif e["type"] in ("literal_error", "enum"):
            msg = f"{msg}, got {shown(e.get('input'))}"
        lines.append(f"{source}{loc}: {msg}")
    return _bounded(lines)


def _bounded(lines: list[str]) -> str:
    """At most MAX_ERROR_LINES lines of at most MAX_LINE characters: a document with a million bad entries
    gets a screenful, not a million lines."""
    out = [ln if len(ln) <= MAX_LINE else ln[:MAX_LINE] + "…" for ln in lines[:MAX_ERROR_LINES]]
    if len(lines) > MAX_ERROR_LINES:
        out.append(f"… and {len(lines) - MAX_ERROR_LINES} more problems")
    return "\n".join(out)


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
                        f"got apiVersion: {shown(doc.get('apiVersion'))}, kind: {shown(doc.get('kind'))}")
    try:
        return TrainingSpec.model_validate(doc, context={"rules": scope})
    except ValidationError as err:
        raise KilnError(format_validation_error(err, prefix)) from None


def load_documents(path: str | Path) -> list[Any]:
    """Every YAML document of a file (empty documents skipped); KilnError for a missing or broken file.

    Plain YAML data only (no tags that build objects), UTF-8, no duplicate keys, and bounded: at most
    MAX_FILE_BYTES, and MAX_NODES nodes / MAX_DEPTH levels with aliases expanded (an alias bomb is refused
    before anything walks it).
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:  # bounded read: /dev/zero or a huge file must not hang or fill memory
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise KilnError(f"{p}: cannot read ({err.strerror})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise KilnError(f"{p}: larger than {MAX_FILE_BYTES >> 20} MiB; a TrainingSpec is a few KiB "
                        f"(the apiserver refuses requests over 3 MiB)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise KilnError(f"{p}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}, line {line}); "
                        f"save the file as UTF-8") from None
    stream = io.StringIO(text)
    stream.name = str(p)  # YAML errors say where: in "<file>", line, column
    loader = _Loader(stream)
    try:
        nodes = []
        while loader.check_node():
            nodes.append(loader.get_node())
            if len(nodes) > MAX_DOCUMENTS:
                raise KilnError(f"{p}: more than {MAX_DOCUMENTS} YAML documents")
        _check_size(nodes, p)
        return [d for d in (loader.construct_document(n) for n in nodes if n is not None) if d is not None]
    except yaml.YAMLError as err:
        raise KilnError(f"{p}: not valid YAML: {_bounded(str(err).splitlines())}") from None
    except RecursionError:  # only without libyaml (which stops at 1000 levels); _check_size stops the rest
        raise KilnError(f"{p}: nested deeper than {MAX_DEPTH} levels") from None
    finally:
        loader.dispose()


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """yaml's safe loader (libyaml when present), refusing duplicate keys and integers no API can store."""

    def construct_mapping(self, node, deep=False):
        # YAML says keys are unique; PyYAML keeps the last silently, which hides a typo'd or pasted-twice key.
        # Explicit keys only: a merge (<<) supplies defaults that explicit keys may override.
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base class says so with its position
                break
            if duplicate:
                raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                        f"found duplicate key {shown(key, 80)}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        if len(node.value) > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(node.value)} characters is "
                                                    "far beyond what Kubernetes stores", node.start_mark)
        return super().construct_yaml_int(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def _check_size(roots: list, path: Path) -> None:
    """Refuse documents whose nodes, with every alias expanded, exceed MAX_NODES or MAX_DEPTH, or that
    contain themselves. Each distinct node is measured once (memo), so a billion-node alias bomb costs
    as much as its few lines of text."""
    memo: dict[int, tuple[int, int]] = {}  # id(node) → (expanded size, height)
    active: set[int] = set()

    def measure(node, depth: int) -> tuple[int, int]:
        key = id(node)
        if key in active:
            raise KilnError(f"{path}: a YAML alias refers to a node that contains it (line {node.start_mark.line + 1})")
        if key not in memo:
            if depth >= MAX_DEPTH:
                raise KilnError(f"{path}: nested deeper than {MAX_DEPTH} levels (line {node.start_mark.line + 1})")
            value = node.value if isinstance(node.value, list) else []
            children = [c for item in value for c in (item if isinstance(item, tuple) else (item,))]
            active.add(key)
            size, height = 1, 1
            for child in children:
                s, h = measure(child, depth + 1)
                size, height = size + s, max(height, h + 1)
                if size > MAX_NODES:  # stop counting: a bomb's size overflows nothing, but time matters
                    break
            active.discard(key)
            memo[key] = (size, height)
        size, height = memo[key]
        if depth + height > MAX_DEPTH:
            raise KilnError(f"{path}: nested deeper than {MAX_DEPTH} levels (line {node.start_mark.line + 1})")
        return size, height

    total = 0
    for root in roots:
        total += measure(root, 0)[0]
        if total > MAX_NODES:
            raise KilnError(f"{path}: more than {MAX_NODES} YAML nodes with aliases expanded (an alias bomb?); "
                            f"a TrainingSpec has a few hundred")


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


def load_one(path: str) -> TrainingSpec:
    """The one TrainingSpec of the file at `path` (a file of several is refused: a command runs one spec)."""
    docs = load_file(path)
    if len(docs) != 1:
        raise KilnError(f"{path}: holds {len(docs)} TrainingSpecs; give a file with exactly one")
    return docs[0]
