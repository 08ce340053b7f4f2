"""`kiln run`, the local launcher, end to end: real torchrun processes, real file:// checkpoints."""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kiln.trainer.observe.exporter import GAUGES
from tests.support.ranks import SAFETY_TIMEOUT_S, wait_for_step
from tests.support.runs import env, kiln, read_metrics, write_spec

QUICKSTART = Path(__file__).resolve().parents[2] / "manifests" / "samples" / "quickstart.yaml"


@pytest.mark.distributed
@pytest.mark.slow
def test_quickstart_writes_metrics_and_rerun_resumes_the_same_curve(tmp_path):
    resumed, fresh = tmp_path / "resumed", tmp_path / "fresh"
    # The first 20 steps are the quickstart's warm-up, where the learning rate does not depend on --steps:
    # a run of 20 steps resumed to 22 must give the same curve as an uninterrupted run of 22. That reference
    # shares nothing with the first run (its own output, torchrun port and processes): it runs beside it, so
    # the two runs' process starts overlap.
    with ThreadPoolExecutor(2) as pool:
        reference = pool.submit(kiln, "run", str(QUICKSTART), "--nproc", "2", "--steps", "22", "--output", str(fresh))
        first = kiln("run", str(QUICKSTART), "--nproc", "2", "--steps", "20", "--output", str(resumed))
        ref = reference.result()
    assert first.returncode == 0, first.stderr[-4000:]
    assert [r["step"] for r in read_metrics(resumed)] == list(range(1, 21))
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step-00000020"

    second = kiln("run", str(QUICKSTART), "--nproc", "2", "--steps", "22", "--output", str(resumed))
    assert second.returncode == 0, second.stderr[-4000:]
    assert "step 21/22" in second.stdout and "step 1/22" not in second.stdout  # it resumed, not restarted

    assert ref.returncode == 0, ref.stderr[-4000:]
    got, want = read_metrics(resumed), read_metrics(fresh)
    assert [r["step"] for r in got] == list(range(1, 23))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-5)
    assert got[-1]["tokens_seen"] == want[-1]["tokens_seen"] == 22 * 16 * 128
    assert want[-1]["loss"] < want[0]["loss"]


@pytest.mark.parametrize(
    "make_spec,expected",
    [
        (lambda d: d / "missing.yaml", ["missing.yaml", "cannot read"]),
        (lambda d: _yaml(d, "spec:\n  training: {steps: -3}\n"), ["spec.training.steps", "greater than or equal to 1"]),
        (lambda d: _yaml(d, "spec:\n  training: {stpes: 3}\n"), ["spec.training.stpes", "unknown field"]),
        (lambda d: _yaml(d, "spec:\n  model: {preset: huge}\n"), ["huge", "tiny"]),
        # 3 processes cannot split a global batch of 16 into microbatches of 8 per rank
        (lambda d: QUICKSTART, ["--nproc 3", "globalBatchSize", "16"]),
        # tensor 2 cannot split 3 processes: the only thing about the world kiln run refuses, naming the flag
        (lambda d: _cluster_spec(d), ["--nproc 3", "parallelism.tensor × parallelism.pipeline = 2 must divide"]),
    ],
    ids=["missing-file", "bad-value", "unknown-field", "unknown-preset", "batch-vs-world", "tensor-vs-nproc"],
)


def test_bad_input_is_a_clear_error(tmp_path, make_spec, expected):
    proc = kiln("run", str(make_spec(tmp_path)), "--nproc", "3", "--output", str(tmp_path / "out"))
    assert proc.returncode == 1
    assert proc.stderr.startswith("kiln: error:"), proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def _yaml(d: Path, body: str) -> Path:
    p = d / "spec.yaml"
    p.write_text("apiVersion: kiln.dev/v1alpha1\nkind: TrainingSpec\n" + body)
    return p


@pytest.mark.distributed
@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_keeps_a_checkpoint(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 100000, "schedule": "constant"}, nproc=2)
    out = tmp_path / "out"
    # SIGINT handled as in a terminal even where this test runs as a background job (`cmd &` without job
    # control starts it with SIGINT ignored, and Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "run", str(spec), "--output", str(out)],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for_step(out / "metrics.jsonl", 2, proc)  # training is under way (100000 steps: it cannot end first)
    except BaseException:
        proc.kill()
        raise
    proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the launcher
    _, stderr = proc.communicate(timeout=SAFETY_TIMEOUT_S)  # the ranks agree on a step, save it and exit
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted; rerun the same command to resume" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    # The ranks agreed on a step, saved it and committed it before exiting.
    saved = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))
    assert saved >= 1 and saved == read_metrics(out)[-1]["step"]


def _cluster_spec(folder: Path) -> Path:
    """A spec written for Kubernetes: 4 nodes x 8 GPUs, tensor 2 inside a node, HSDP over 4 replica groups,
    a global batch of 48 (data-parallel 16 x microbatch 3)."""
    return write_spec(folder / "cluster.yaml", model={"preset": "tiny", "layers": 2, "seqLen": 32},
                      training={"steps": 2, "globalBatchSize": 48, "microBatchSize": 3},
                      parallelism={"tensor": 2, "replicate": 4},
                      resources={"nodes": 4, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"},
                      elastic={"minNodes": 2, "maxNodes": 8})


@pytest.mark.distributed
def test_a_cluster_spec_runs_on_two_local_processes_with_its_global_batch(tmp_path):
    spec, out = _cluster_spec(tmp_path), tmp_path / "out"
    assert kiln("validate", str(spec)).returncode == 0  # as written, it is valid for the cluster
    proc = kiln("run", str(spec), "--nproc", "2", "--output", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "kiln: note: --nproc 2: parallelism.replicate 4 → 1" in proc.stdout
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert {(r["world"], r["tp"], r["dp_replicate"], r["dp_shard"]) for r in records} == {(2, 2, 1, 1)}
    assert records[-1]["tokens_seen"] == 2 * 48 * 32  # every step trained on the spec's 48 sequences
    # every series the trainer's exporter offers is fed by these records (goodput and restarts never were); the
    # router's series only by a mixture of experts (tests/distributed/test_moe_run.py)
    dense = {g for g in GAUGES if not g.startswith("moe_")}
    assert dense and dense <= set(records[-1])
