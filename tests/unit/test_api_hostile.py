"""Hostile and careless input to `kiln validate` and `kiln render` (issue 13, item 10).

Every file gets an answer: exit 0, or exit 1 with a short error that names the cause. Never a traceback,
a hang, megabytes of output, a silently dropped key or a default run made from a typo. The CRD carries the
same integer bounds, so the apiserver refuses what `kiln validate` refuses (tests/integration checks that
on a real apiserver).
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from kiln.api.load import MAX_ERROR_LINES, MAX_LINE, parse
from kiln.api.spec import INT32_MAX, JSON_INT_MAX
from kiln.cli.main import main
from kiln.errors import KilnError
from tests.support.specs import CRD_ROOT, SPEC_INTS, doc_with, integer_fields

ROOT = Path(__file__).resolve().parents[2]
HEAD = "apiVersion: kiln.dev/v1alpha1\nkind: TrainingSpec\nmetadata: {name: hostile}\n"
ERR_LIMIT = (MAX_ERROR_LINES + 2) * (MAX_LINE + 10)  # what an error may print, at most
OUT_LIMIT = 1 << 20  # render: the objects of a spec within the loader's node bound stay well under this

# Fields that become int32 in the objects kiln makes (or multiply them in the CEL rules).
INT32_FIELDS = {"spec.resources.nodes", "spec.elastic.minNodes", "spec.elastic.maxNodes", "spec.elastic.maxRestarts",
                "spec.elastic.plan[].nodes", "spec.parallelism.tensor", "spec.parallelism.pipeline",
                "spec.parallelism.pipelineMicrobatches", "spec.parallelism.replicate"}


def cli(*argv: str) -> tuple[int, str, str]:
    """`kiln ARGV` in this process: (exit code, stdout, stderr). An exception escaping main fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def assert_answered(rc: int, out: str, err: str) -> None:
    assert rc in (0, 1), (rc, err[:2000])
    assert "Traceback" not in err and "Traceback" not in out
    assert len(err) <= ERR_LIMIT, f"{len(err)} characters of errors: {err[:500]}"
    assert len(out) <= OUT_LIMIT, f"{len(out)} characters of output"


def bomb(indent: str) -> str:
    """Billion laughs: anchors a..i, each nine of the one before (9^9 leaves once expanded)."""
    return (f"{indent}a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
            + "".join(f"{indent}{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")))


# (name, file bytes, a fragment the error must contain). Each one failed before the loader was hardened:
# a traceback, a silent last-wins or default run, an error echoing the input whole, or minutes of looping.
HOSTILE = [
    ("alias bomb in a passed-through map", (HEAD + "spec:\n  resources:\n    affinity:\n" + bomb(" " * 6)).encode(),
     "alias bomb"),
    ("alias bomb as kind", (HEAD.replace("kind: TrainingSpec\n", "") + "bombs:\n" + bomb("  ") + "kind: *i\n").encode(),
     "alias bomb"),
    ("recursive alias", (HEAD + "spec:\n  resources:\n    affinity: &a {x: [*a]}\n").encode(), "contains it"),
    ("alias chain nesting", (HEAD + "spec:\n  resources:\n    affinity:\n      a0: &a0 [1]\n"
                             + "".join(f"      a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 100))).encode(),
     "nested deeper than"),
    ("deep flow nesting", (HEAD + "spec: {resources: {affinity: {x: " + "[" * 5000 + "]" * 5000 + "}}}\n").encode(),
     "nest"),
    ("non-UTF-8 bytes", HEAD.encode() + b"spec: {image: \"\xff\xfe\"}\n", "not UTF-8 text (byte 0xff"),
    ("duplicate key", (HEAD + "spec:\n  training: {steps: 5}\n  training: {steps: 7}\n").encode(),
     "duplicate key 'training'"),
    ("duplicate top-level spec", (HEAD + "spec: {training: {steps: 5}}\nspec: {}\n").encode(), "duplicate key 'spec'"),
    ("typo of spec", (HEAD + "sepc:\n  training: {steps: 5}\n").encode(), "sepc: unknown field"),
    ("replicas beyond int32", (HEAD + f"spec: {{resources: {{nodes: {INT32_MAX + 1}}}}}\n").encode(),
     "spec.resources.nodes: Input should be less than or equal to 2147483647"),
    ("steps beyond 2^53 - 1", (HEAD + f"spec: {{training: {{steps: {JSON_INT_MAX + 1}}}}}\n").encode(),
     "spec.training.steps: Input should be less than or equal to 9007199254740991"),
    ("steps beyond int64", (HEAD + f"spec: {{training: {{steps: {2**63}}}}}\n").encode(),
     "spec.training.steps: Input should be less than or equal to 9007199254740991"),
    ("integer of 5000 digits", (HEAD + "spec: {training: {seed: " + "9" * 5000 + "}}\n").encode(),
     "far beyond what Kubernetes stores"),
    ("infinite learning rate", (HEAD + "spec: {training: {lr: .inf, minLrRatio: .nan}}\n").encode(),
     "spec.training.lr: Input should be a finite number"),
    # 2^53 - 111, a prime within the bound: listing its divisors by trial took years of CPU
    ("divisibility with huge heads", (HEAD + "spec:\n  model: {preset: tiny, heads: 9007199254740881, "
                                      "kvHeads: 7}\n  parallelism: {tensor: 3}\n").encode(),
     "spec.model.kvHeads: model.kvHeads must divide model.heads"),
    ("a megabyte of kind", ("kind: " + "x" * (1 << 20) + "\n").encode(), "expected apiVersion"),
    ("a thousand bad values", (HEAD + "spec: {resources: {nodeSelector: {"
                               + ", ".join(f"k{i}: {i}" for i in range(1000)) + "}}}\n").encode(), "more problems"),
    ("too many documents", b"---\n{}\n" * 300, "more than 256 YAML documents"),
    ("over the size limit", b"# " + b"x" * (4 << 20) + b"\n", "larger than 3 MiB"),
]


@pytest.mark.timeout(120)  # a hang guard only: before the fix the divisibility case looped for many minutes
@pytest.mark.parametrize("name,text,fragment", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_file_gets_a_short_clear_error(tmp_path, name, text, fragment):
    path = tmp_path / "spec.yaml"
    path.write_bytes(text)
    for command in ("validate", "render"):
        rc, out, err = cli(command, str(path))
        assert_answered(rc, out, err)
        assert rc == 1 and out == "", (command, out[:500])
        assert str(path) in err and fragment in err, (command, err[:1000])


def test_yaml_tags_build_no_objects_and_run_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "spec.yaml"
    path.write_text(HEAD + f"spec: !!python/object/apply:os.system ['touch {marker}']\n")
    for command in ("validate", "render"):
        rc, out, err = cli(command, str(path))
        assert_answered(rc, out, err)
        assert rc == 1 and "could not determine a constructor" in err
    assert not marker.exists()


def test_merge_keys_may_be_overridden_and_are_no_duplicates(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(HEAD + "spec:\n  resources:\n    tolerations:\n"
                    "      - &t {key: a, operator: Exists, effect: NoSchedule}\n      - {<<: *t, key: b}\n")
    rc, out, err = cli("render", str(path))
    assert rc == 0, err
    jobs = [o for o in yaml.safe_load_all(out) if o["kind"] == "PyTorchJob"]
    pod = jobs[0]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert [t["key"] for t in pod["tolerations"] if t["key"] in ("a", "b")] == ["a", "b"]


def test_an_unreadable_stream_is_refused_without_reading_it_all(tmp_path):
    rc, out, err = cli("validate", "/dev/zero")  # endless: kiln runs on Linux, which always has it
    assert_answered(rc, out, err)
    assert rc == 1 and "larger than 3 MiB" in err


# ---- the integer bounds are the CRD's bounds ----

def test_every_integer_in_the_crd_has_the_bound_kubernetes_stores():
    status_ints = dict(integer_fields(CRD_ROOT["status"], "status"))
    assert len(SPEC_INTS) > 20 and status_ints
    for path, schema in {**SPEC_INTS, **status_ints}.items():
        # the apiserver takes only bounds a JSON number holds exactly (it refused the CRD with 2^63 - 1)
        assert "maximum" in schema and schema["maximum"] <= JSON_INT_MAX, path
        assert schema.get("minimum", -JSON_INT_MAX) >= -JSON_INT_MAX, path
    for path in INT32_FIELDS:
        assert SPEC_INTS[path]["maximum"] == INT32_MAX, path


@pytest.mark.parametrize("path", sorted(SPEC_INTS))
def test_kiln_refuses_one_past_each_integer_bound(path):
    bound = SPEC_INTS[path]["maximum"]
    with pytest.raises(KilnError) as err:
        parse(doc_with(path, bound + 1), "f.yaml")
    assert f"f.yaml: {path.replace('[]', '.0')}" in str(err.value) and "less than or equal to" in str(err.value)


# ---- property test: random hostile documents ----

_PATHS = sorted(SPEC_INTS) + ["spec.image", "spec.data.uri", "spec.model.preset", "spec.resources.nodeSelector",
                              "spec.resources.affinity", "spec.resources.tolerations", "spec.training.lr",
                              "spec.checkpoint.intervalSteps", "spec.checkpoint.uri", "metadata.name", "kind",
                              "apiVersion", "spec", "metadata", "spec.elastic.plan"]
_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2, 3, 7, INT32_MAX, INT32_MAX + 1, JSON_INT_MAX, JSON_INT_MAX + 1, 2**63, -(2**63) - 1,
                     10**18 + 9, 9007199254740881]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.just("x" * 200_000),
    st.none(), st.booleans(),
    st.lists(st.integers(0, 10), max_size=4),
    st.dictionaries(st.text(max_size=4), st.one_of(st.integers(), st.text(max_size=4)), max_size=3),
)


def _set(doc: dict, path: str, value) -> None:
    node = doc
    parts = path.replace("[]", "").split(".")
    for key in parts[:-1]:
        child = node.get(key)
        if isinstance(child, list):
            child = child[0] if child and isinstance(child[0], dict) else None
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[parts[-1]] = value


@st.composite
def hostile_documents(draw) -> bytes:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "h"},
           "spec": {"model": {"preset": "tiny"}, "training": {"steps": 10, "globalBatchSize": 4},
                    "resources": {"nodes": 2}, "elastic": {"plan": [{"untilStep": 5, "nodes": 2}, {"nodes": 2}]}}}
    for path, value in draw(st.lists(st.tuples(st.sampled_from(_PATHS), _VALUES), max_size=4)):
        _set(doc, path, value)
    if draw(st.booleans()):
        doc[draw(st.sampled_from(["sepc", "Spec", "status", "extra"]))] = {"training": {"steps": 1}}
    text = yaml.safe_dump(doc, sort_keys=False, width=1 << 30).encode()
    edit = draw(st.sampled_from(["none", "bomb", "duplicate", "bytes", "truncate", "nest"]))
    if edit == "bomb":
        alias = draw(st.sampled_from([b"a", b"b", b"i"]))  # from 9 leaves to 9^9
        text = b"bombs:\n" + bomb("  ").encode() + text.replace(b"name: h", b"name: *" + alias, 1)
    elif edit == "duplicate":
        text += draw(st.sampled_from([b"spec: {}\n", b"kind: TrainingSpec\n", b"metadata: {name: x}\n"]))
    elif edit == "bytes":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.binary(min_size=1, max_size=6)) + text[at:]
    elif edit == "truncate":
        text = text[:draw(st.integers(0, len(text)))]
    elif edit == "nest":
        depth = draw(st.integers(60, 2000))
        text += b"extra: " + b"[" * depth + b"]" * depth + b"\n"
    return text


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile") / "spec.yaml"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(text=hostile_documents())
def test_random_hostile_documents_are_answered(scratch, text):
    scratch.write_bytes(text)
    rc_local, out, err = cli("validate", "--local", str(scratch))
    assert_answered(rc_local, out, err)
    rc_validate, out, err = cli("validate", str(scratch))
    assert_answered(rc_validate, out, err)
    rc_render, out, err = cli("render", str(scratch))
    assert_answered(rc_render, out, err)
    # render renders for Kubernetes, so it checks what `validate` checks (the cluster's rules too): a file
    # one accepts, the other renders; `--local` drops only rules, so it accepts whatever `validate` accepts
    assert rc_render == rc_validate, err[:2000]
    assert rc_validate != 0 or rc_local == 0


# ---- the real command, as a user runs it ----

@pytest.mark.parametrize("name", ["alias bomb in a passed-through map", "non-UTF-8 bytes", "duplicate key",
                                  "divisibility with huge heads", "typo of spec"])


def test_kiln_validate_process_answers_hostile_files(tmp_path, name):
    _, text, fragment = next(c for c in HOSTILE if c[0] == name)
    path = tmp_path / "spec.yaml"
    path.write_bytes(text)
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", "validate", str(path)], capture_output=True,
                          text=True, timeout=300)  # a hang guard only
    assert proc.returncode == 1 and proc.stdout == ""
    assert fragment in proc.stderr and "Traceback" not in proc.stderr and len(proc.stderr) <= ERR_LIMIT
