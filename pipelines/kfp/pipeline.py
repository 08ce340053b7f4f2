"""A Kubeflow Pipelines (v2) pipeline: validate → train → evaluate → publish if the held-out loss is good enough.

  validate  `kiln validate` on the TrainingSpec given as a pipeline parameter (YAML text)
  train     creates the TrainingSpec with `kiln submit` and waits with `kiln wait`; fails when the run fails
  evaluate  `kiln eval`: loads the run's newest committed checkpoint (every file checked against its COMMIT)
            into one process and scores it on the validation split of the spec's data; outputs its `loss`
            and `step`. It runs in the trainer image (the only kiln image with torch), on CPU by default.
  publish   only when loss <= the parameter `max_eval_loss`: copies that checkpoint to a release location,
            COMMIT last, so readers see all of it or none

A second pipeline, `kiln-prepare-train`, runs `kiln data prepare` first (raw .txt/.jsonl/.parquet under
`inputs` → token shards at `data_uri`, which the spec's data.uri must name), then the same steps.

validate, train and publish run in the kiln operator image (the kiln CLI and storage, without torch);
prepare and evaluate in the trainer image (tokenizers, torch).
Compile:  python pipelines/kfp/pipeline.py --out kiln-train.yaml   (then upload it to Kubeflow Pipelines)
          python pipelines/kfp/pipeline.py --pipeline prepare-train --out kiln-prepare-train.yaml
The pipeline's ServiceAccount needs RBAC to create and read TrainingSpecs; S3 credentials come from the
Secret named by the parameter `credentials_secret` (keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).
"""

# No `from __future__ import annotations`: kfp reads the parameter annotations as real types.
import argparse

from kfp import compiler, dsl, kubernetes

KILN_IMAGE = "ghcr.io/kiln-dev/kiln-operator:0.1.0"
TRAINER_IMAGE = "ghcr.io/kiln-dev/kiln-trainer:0.1.0"  # has torch: kiln eval loads the model


@dsl.container_component
def validate(spec: str):
    """Refuse a spec `kiln validate` refuses (its message names the field) before anything is created."""
    return dsl.ContainerSpec(
        image=KILN_IMAGE,
        command=["sh", "-c", 'printf "%s" "$0" > /tmp/spec.yaml && kiln validate /tmp/spec.yaml'],
        args=[spec],
    )


@dsl.container_component
def prepare(inputs: str, tokenizer: str, data_uri: str, endpoint: str, dedup: str):
    """`kiln data prepare`: clean, deduplicate and tokenize `inputs` (space-separated files, folders, file:// or
    s3:// prefixes) into token shards and a manifest at `data_uri`. A rerun skips the shards already written."""
    return dsl.ContainerSpec(
        image=TRAINER_IMAGE,
        # set -f: the inputs are split on spaces, never expanded as globs
        command=["sh", "-c", """
set -euf
kiln data prepare --input $0 --tokenizer "$1" --output "$2" --dedup "$4" ${3:+--endpoint "$3"}
"""],
        args=[inputs, tokenizer, data_uri, endpoint, dedup],
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


@dsl.container_component
def evaluate(spec: str, checkpoint_uri: str, endpoint: str, eval_data: str, loss: dsl.OutputPath(float),
             step: dsl.OutputPath(int)):
    """`kiln eval` of the newest committed checkpoint; its held-out loss and step become the outputs.
    No committed (or no intact) checkpoint fails the step with kiln's message naming the URI. eval_data: held-out
    token shards, for specs whose data.uri has no validation split of its own ("" = the spec's split)."""
    return dsl.ContainerSpec(
        image=TRAINER_IMAGE,
        command=["sh", "-c", """
set -eu
printf '%s' "$0" > /tmp/spec.yaml
kiln eval /tmp/spec.yaml --checkpoint "$1" ${2:+--endpoint "$2"} ${3:+--data "$3"} --json /tmp/eval.json
mkdir -p "$(dirname "$4")" "$(dirname "$5")"
python -c 'import json, sys; r = json.load(open(sys.argv[1])); open(sys.argv[2], "w").write(repr(r["loss"])); open(sys.argv[3], "w").write(str(r["step"]))' /tmp/eval.json "$4" "$5"
"""],
        args=[spec, checkpoint_uri, endpoint, eval_data, loss, step],
    )


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


def _use_s3_secret(task, credentials_secret: str) -> None:
    kubernetes.use_secret_as_env(task, secret_name=credentials_secret, secret_key_to_env={
        "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"})


def _train_evaluate_publish(first, spec, checkpoint_uri, release_uri, max_eval_loss, endpoint, credentials_secret,
                            timeout, eval_data) -> None:
    """train → evaluate → publish behind the loss gate, after the task `first`; both pipelines end so.
    Defined before them: @dsl.pipeline builds the graph when it decorates."""
    trained = train(spec=spec, timeout=timeout).after(first)
    trained.set_caching_options(False)  # a training run is never "the same" as an earlier one
    scored = evaluate(spec=spec, checkpoint_uri=checkpoint_uri, endpoint=endpoint, eval_data=eval_data).after(trained)
    tasks = [scored]
    # The gate: a checkpoint whose held-out loss is above max_eval_loss is not published (the run shows
    # the condition as not met, and evaluate's `loss` output says by how much).
    with dsl.If(scored.outputs["loss"] <= max_eval_loss, name="eval-loss-within-max"):
        tasks.append(publish(checkpoint_uri=checkpoint_uri, endpoint=endpoint, step=scored.outputs["step"],
                             release_uri=release_uri))
    for task in tasks:
        task.set_caching_options(False)
        _use_s3_secret(task, credentials_secret)


@dsl.pipeline(name="kiln-train", description="Validate, train, evaluate and publish a kiln TrainingSpec.")
def kiln_train(spec: str, checkpoint_uri: str, release_uri: str, max_eval_loss: float, endpoint: str = "",
               credentials_secret: str = "", timeout: str = "24h", eval_data: str = ""):
    checked = validate(spec=spec)
    _train_evaluate_publish(checked, spec, checkpoint_uri, release_uri, max_eval_loss, endpoint, credentials_secret,
                            timeout, eval_data)


@dsl.pipeline(name="kiln-prepare-train",
              description="Prepare token shards from raw text, then validate, train, evaluate and publish.")
def kiln_prepare_train(spec: str, inputs: str, tokenizer: str, data_uri: str, checkpoint_uri: str, release_uri: str,
                       max_eval_loss: float, endpoint: str = "", credentials_secret: str = "", dedup: str = "exact",
                       timeout: str = "24h", eval_data: str = ""):
    checked = validate(spec=spec)  # a wrong spec fails in seconds, before hours of preparation
    prepared = prepare(inputs=inputs, tokenizer=tokenizer, data_uri=data_uri, endpoint=endpoint,
                       dedup=dedup).after(checked)
    _use_s3_secret(prepared, credentials_secret)
    _train_evaluate_publish(prepared, spec, checkpoint_uri, release_uri, max_eval_loss, endpoint, credentials_secret,
                            timeout, eval_data)


PIPELINES = {"train": kiln_train, "prepare-train": kiln_prepare_train}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Compile the kiln Kubeflow pipeline to its YAML IR.")
    parser.add_argument("--out", default="kiln-train.yaml", help="where to write the compiled pipeline")
    parser.add_argument("--pipeline", choices=PIPELINES, default="train",
                        help="train: validate → train → evaluate → publish; prepare-train: kiln data prepare first")
    args = parser.parse_args(argv)
    compiler.Compiler().compile(PIPELINES[args.pipeline], package_path=args.out)


if __name__ == "__main__":
    main()
