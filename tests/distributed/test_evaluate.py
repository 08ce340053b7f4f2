"""`kiln eval`: the held-out loss of a run's newest committed checkpoint, loaded into one process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

from kiln.api.load import load_file
from kiln.cli.main import main
from kiln.trainer.evaluate import evaluate
from tests.support.ranks import SAFETY_TIMEOUT_S
from tests.support.runs import MICRO_MODEL, env, kiln, read_metrics, validation_tokens, write_spec


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_of_a_two_rank_run_matches_its_val_loss_and_beats_the_untrained_model(tmp_path, capsys):
    # 2 ranks with FSDP save sharded weights; kiln eval reads them into one process (DCP reshards).
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 8, "lr": 3e-3, "warmupSteps": 2}, nproc=2)
    out = tmp_path / "out"
    run = kiln("run", str(spec), "--output", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    logged = read_metrics(out)[-1]
    assert logged["step"] == 8 and logged["world_size"] == 2

    result = tmp_path / "eval" / "result.json"
    assert main(["eval", str(spec), "--output", str(out), "--json", str(result)]) == 0  # in this process
    printed = capsys.readouterr().out
    got = json.loads(result.read_text())
    assert set(got) == {"step", "loss", "perplexity", "tokens", "checkpoint"}
    assert got["step"] == 8
    assert math.isfinite(got["loss"]) and got["perplexity"] == pytest.approx(math.exp(got["loss"]))
    # The same 4 global batches of the validation split as the trainer's val_loss, in fp32: equal up to the
    # summation order of 2 FSDP ranks versus one process.
    assert got["loss"] == pytest.approx(logged["val_loss"], rel=1e-5)
    assert got["tokens"] == 4 * 4 * 32  # batches x globalBatchSize x seqLen
    assert f"step 8 of file://{out.resolve()}/checkpoints" in printed
    assert f"held-out loss {got['loss']:.4f}" in printed

    # --max-loss: the CI gate fails above the threshold, after printing the result
    assert main(["eval", str(spec), "--output", str(out), "--max-loss", f"{got['loss'] + 0.01:.4f}"]) == 0
    assert main(["eval", str(spec), "--output", str(out), "--max-loss", f"{got['loss'] - 0.01:.4f}"]) == 1
    printed, err = capsys.readouterr()
    assert printed.count("held-out loss") == 2 and "is above --max-loss" in err, err

    # --data: held-out shards from a folder; here the validation split's own bytes, so the same loss
    held_out = tmp_path / "held-out"
    held_out.mkdir()
    np.save(held_out / "val.npy", validation_tokens())
    assert main(["eval", str(spec), "--output", str(out), "--data", f"file://{held_out}/",
                 "--json", str(tmp_path / "data.json")]) == 0
    assert json.loads((tmp_path / "data.json").read_text())["loss"] == got["loss"]

    # a spec of another model shape cannot read these weights: one line naming the checkpoint and the cause
    other = write_spec(tmp_path / "other.yaml", model={**MICRO_MODEL, "dim": 32}, nproc=2)
    assert main(["eval", str(other), "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: checkpoint step 8 at file://") and "does not fit this model" in err, err

    doc = load_file(spec)[0]
    again = evaluate(doc, checkpoint_uri=got["checkpoint"], device=torch.device("cpu"))
    assert (again.step, again.loss) == (8, got["loss"])  # deterministic: same batches, same order
    untrained = evaluate(doc, checkpoint_uri=None, device=torch.device("cpu"))  # the weights step 1 starts from
    assert untrained.step == 0 and untrained.tokens == got["tokens"]
    assert got["loss"] < untrained.loss - 0.1, (got["loss"], untrained.loss)


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_of_a_pipeline_parallel_checkpoint_in_the_s3_store(rig, tmp_path, monkeypatch, capsys):
    from kiln.storage import open_store

    keys = {"AWS_ACCESS_KEY_ID": rig.s3_access_key, "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key}
    uri = f"s3://{rig.s3_bucket}/test-eval/{uuid.uuid4().hex}/"
    # pipeline=2: each rank saves only its own stage's blocks; one process loads the whole model from both.
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 3, "lr": 3e-3}, parallelism={"pipeline": 2},
                      checkpoint={"uri": uri, "endpoint": rig.s3_endpoint}, nproc=2)
    out = tmp_path / "out"
    try:
        run = subprocess.run([sys.executable, "-m", "kiln.cli.main", "run", str(spec), "--output", str(out)],
                             env=env(**keys), capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S, check=False)
        assert run.returncode == 0, run.stderr[-3000:]
        for name, value in keys.items():
            monkeypatch.setenv(name, value)
        # the spec's own checkpoint.uri and endpoint
        assert main(["eval", str(spec), "--json", str(tmp_path / "a.json")]) == 0
        got = json.loads((tmp_path / "a.json").read_text())
        assert (got["step"], got["checkpoint"]) == (3, uri)
        logged = read_metrics(out)[-1]
        assert logged["pp"] == 2
        # the pipeline's last stage takes the loss from the logits, one process uses the fused kernel: 1e-5
        assert got["loss"] == pytest.approx(logged["val_loss"], rel=1e-5)
        # a spec without a store, pointed at it from the command line
        bare = write_spec(tmp_path / "bare.yaml", training={"steps": 3, "lr": 3e-3}, parallelism={"pipeline": 2},
                          nproc=2)
        assert main(["eval", str(bare), "--checkpoint", uri, "--endpoint", rig.s3_endpoint,
                     "--json", str(tmp_path / "b.json")]) == 0
        assert json.loads((tmp_path / "b.json").read_text())["loss"] == got["loss"]
        assert f"step 3 of {uri}" in capsys.readouterr().out
    finally:
        open_store(uri, endpoint=rig.s3_endpoint, env=keys).delete_prefix("")


@pytest.mark.parametrize("args,says", [
    (["--output", "{tmp}/never-trained"], ["no committed checkpoint under file://{tmp}/never-trained/checkpoints"]),
    (["--checkpoint", "ftp://host/x"], ["ftp://host/x", "s3://bucket/prefix/ or file:///path/"]),
    (["--batches", "0"], ["--batches must be at least 1, not 0"]),
    (["--device", "cuda:99"], ["--device cuda:99", "use --device cpu"]),
    (["--data", "file://{tmp}/no-such-dir/"], ["--data", "{tmp}/no-such-dir/", "no such folder"]),
], ids=["uncommitted", "bad-uri", "no-batches", "no-such-gpu", "missing-data"])


def test_eval_bad_input_is_a_clear_error(tmp_path, capsys, args, says):
    spec = write_spec(tmp_path / "spec.yaml")
    # A step folder without COMMIT (a save that died before committing) does not count as a checkpoint.
    (tmp_path / "never-trained" / "checkpoints" / "step-00000004").mkdir(parents=True)
    assert main(["eval", str(spec), *(a.format(tmp=tmp_path) for a in args)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kiln: error:"), err
    for text in says:
        assert text.format(tmp=tmp_path) in err, err


def test_eval_refuses_token_shards_without_held_out_data(tmp_path, capsys):
    (tmp_path / "shards").mkdir()
    spec = write_spec(tmp_path / "spec.yaml", data=f"file://{tmp_path}/shards/")
    assert main(["eval", str(spec), "--output", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "has no held-out split" in err and "--data" in err, err
