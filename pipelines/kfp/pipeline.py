"""A Kubeflow Pipelines (v2) pipeline: validate → train → evaluate the final checkpoint → publish.

Every step runs in the kiln operator image (the kiln CLI and storage, without torch):
  validate  `kiln validate` on the TrainingSpec given as a pipeline parameter (YAML text)
  train     creates the TrainingSpec with `kiln submit` and waits with `kiln wait`; fails when the run fails
  evaluate  checks the run's final committed checkpoint against its COMMIT (every file's size and sha256)
            and records its step and size as KFP metrics
  publish   copies that checkpoint to a release location, COMMIT last, so readers see all of it or none

Compile:  python pipelines/kfp/pipeline.py --out kiln-train.yaml   (then upload it to Kubeflow Pipelines)
The pipeline's ServiceAccount needs RBAC to create and read TrainingSpecs; S3 credentials come from the
Secret named by the parameter `credentials_secret` (keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).
"""

# No `from __future__ import annotations`: kfp reads the parameter annotations as real types.
import argparse

from kfp import compiler, dsl, kubernetes

KILN_IMAGE = "ghcr.io/kiln-dev/kiln-operator:0.1.0"


@dsl.container_component
def validate(spec: str):
    """Refuse a spec `kiln validate` refuses (its message names the field) before anything is created."""
    return dsl.ContainerSpec(
        image=KILN_IMAGE,
        command=["sh", "-c", 'printf "%s" "$0" > /tmp/spec.yaml && kiln validate /tmp/spec.yaml'],
        args=[spec],
    )


@dsl.container_component
def train(spec: str, timeout: str, run: dsl.OutputPath(str)):
    """Create the TrainingSpec and wait for it; `kiln wait` exits non-zero (failing the step) unless it succeeded."""
    return dsl.ContainerSpec(
        image=KILN_IMAGE,
        command=["sh", "-c", """
set -eu
printf '%s' "$0" > /tmp/spec.yaml
name=$(python -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["metadata"]["name"])' /tmp/spec.yaml)
mkdir -p "$(dirname "$2")" && printf '%s' "$name" > "$2"
kiln submit /tmp/spec.yaml
kiln wait "$name" --for succeeded --timeout "$1"
"""],
        args=[spec, timeout, run],
    )


@dsl.component(base_image=KILN_IMAGE)
def evaluate(checkpoint_uri: str, endpoint: str, metrics: dsl.Output[dsl.Metrics]) -> int:
    """Verify the newest committed checkpoint file by file against its COMMIT; return its step."""
    from kiln.errors import KilnError
    from kiln.storage import open_store
    from kiln.storage.commit import committed_steps, read_commit, verify_files

    store = open_store(checkpoint_uri, endpoint=endpoint or None)
    steps = committed_steps(store)
    if not steps:
        raise KilnError(f"no committed checkpoint under {checkpoint_uri}")
    step = steps[0]
    commit = read_commit(store, step)
    problems = verify_files(store, step, commit, sorted(commit.files))
    if problems:
        raise KilnError(f"checkpoint step {step} under {checkpoint_uri} is damaged: " + "; ".join(problems))
    metrics.log_metric("step", step)
    metrics.log_metric("files", len(commit.files))
    metrics.log_metric("bytes", sum(entry.size for entry in commit.files.values()))
    return step


@dsl.component(base_image=KILN_IMAGE)
def publish(checkpoint_uri: str, endpoint: str, step: int, release_uri: str) -> str:
    """Copy one committed checkpoint to release_uri/step-N/, its COMMIT last, then `latest`; return where it is."""
    import tempfile

    from kiln.storage import open_store
    from kiln.storage.commit import COMMIT, LATEST, step_dir

    source = open_store(checkpoint_uri, endpoint=endpoint or None)
    target = open_store(release_uri, endpoint=endpoint or None)
    prefix = step_dir(step)
    names = [info.key for info in source.list(prefix + "/") if not info.key.endswith("/" + COMMIT)]
    with tempfile.TemporaryDirectory() as tmp:
        for key in names + [f"{prefix}/{COMMIT}"]:  # COMMIT last: a reader trusts only what it covers
            local = f"{tmp}/object"
            source.get_file(key, local)
            target.put_file(key, local)
    target.put_bytes(LATEST, (prefix + "\n").encode())
    return target.url(prefix + "/")


@dsl.pipeline(name="kiln-train", description="Validate, train, evaluate and publish a kiln TrainingSpec.")
def kiln_train(spec: str, checkpoint_uri: str, release_uri: str, endpoint: str = "",
               credentials_secret: str = "", timeout: str = "24h"):
    checked = validate(spec=spec)
    trained = train(spec=spec, timeout=timeout).after(checked)
    trained.set_caching_options(False)  # a training run is never "the same" as an earlier one
    scored = evaluate(checkpoint_uri=checkpoint_uri, endpoint=endpoint).after(trained)
    published = publish(checkpoint_uri=checkpoint_uri, endpoint=endpoint, step=scored.outputs["Output"],
                        release_uri=release_uri)
    for task in (scored, published):
        task.set_caching_options(False)
        kubernetes.use_secret_as_env(task, secret_name=credentials_secret, secret_key_to_env={
            "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Compile the kiln Kubeflow pipeline to its YAML IR.")
    parser.add_argument("--out", default="kiln-train.yaml", help="where to write the compiled pipeline")
    args = parser.parse_args(argv)
    compiler.Compiler().compile(kiln_train, package_path=args.out)


if __name__ == "__main__":
    main()
