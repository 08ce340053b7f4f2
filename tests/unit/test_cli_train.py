"""`kiln run --steps` / `kiln train --steps`: a command-line override shortens a real spec's run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.api.load import load_file
from kiln.cli.checkpoint_cmds import eval_checkpoint_uri
from kiln.cli.local_run import local_spec
from kiln.cli.main import main
from kiln.errors import KilnError
from kiln.trainer.optim import lr_at
from tests.support.ranks import SAFETY_TIMEOUT_S, free_port
from tests.support.runs import env, read_metrics, write_spec

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"


def test_steps_shorter_than_warmup_caps_the_warmup_with_a_note(tmp_path):
    doc = load_file(SAMPLES / "gpu-single-node.yaml")[0]  # warmupSteps 1000, steps 20000
    run, (note,) = local_spec(doc, nproc=8, steps=5, output=tmp_path)
    assert (run.spec.training.steps, run.spec.training.warmup_steps) == (5, 5)
    assert "--steps 5" in note and "warmupSteps 1000" in note
    # The warm-up now ends inside the run: the last step trains at the peak learning rate.
    assert lr_at(5, run.spec.training) == pytest.approx(doc.spec.training.lr)
    assert doc.spec.training.warmup_steps == 1000  # the spec as read is not changed


def test_steps_longer_than_warmup_keeps_it_and_says_nothing(tmp_path):
    doc = load_file(SAMPLES / "quickstart.yaml")[0]  # warmupSteps 20
    run, notes = local_spec(doc, nproc=2, steps=50, output=tmp_path)
    assert (run.spec.training.steps, run.spec.training.warmup_steps, notes) == (50, 20, [])
    run, notes = local_spec(doc, nproc=2, steps=None, output=tmp_path)
    assert (run.spec.training.steps, run.spec.training.warmup_steps, notes) == (300, 20, [])


def test_one_node_with_tensor_2_runs_on_two_local_processes_without_processes_per_node(tmp_path):
    # nodes: 1 on CPU means one process per node on Kubernetes, where tensor 2 cannot run; kiln run --nproc 2
    # is one node of 2 processes, where it can: the file loads, and the run spec is that world's.
    spec = write_spec(tmp_path / "spec.yaml", parallelism={"tensor": 2}, resources={"nodes": 1})
    (doc,) = load_file(spec)
    run, notes = local_spec(doc, nproc=2, steps=None, output=tmp_path)
    assert (run.spec.resources.nodes, run.spec.resources.processes_per_node, notes) == (1, 2, [])
    with pytest.raises(KilnError, match="--nproc 1: parallelism.tensor × parallelism.pipeline = 2 must divide"):
        local_spec(doc, nproc=1, steps=None, output=tmp_path)


def test_the_spec_file_itself_still_must_keep_warmup_within_steps(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 3, "warmupSteps": 10})
    with pytest.raises(KilnError, match="warmupSteps"):
        load_file(spec)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("command", ["run", "train"])
def test_steps_below_warmup_trains_to_the_peak_lr_and_says_so_once(tmp_path, command):
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 50, "warmupSteps": 10, "lr": 1e-3})
    out = tmp_path / "out"
    if command == "run":
        args = ["run", str(spec), "--nproc", "1"]
    else:  # one rank without torchrun, as a pod's torchrun would start it
        args = ["train", "--config", str(spec)]
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", *args, "--steps", "2", "--output", str(out)],
                          env=env(MASTER_PORT=str(free_port())), capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("kiln: note: --steps 2 is shorter than training.warmupSteps 10") == 1, proc.stdout
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert [r["lr"] for r in records] == pytest.approx([5e-4, 1e-3])  # warm-up over the 2 steps, to the peak


@pytest.mark.distributed
def test_a_finished_rank_leaves_without_interpreter_finalization(tmp_path):
    # where gloo's threads can still hold tensors and freeing them aborts a finished rank (SIGABRT, pytorch#179291):
    # torchrun then reports the rank failed and the PyTorchJob a failure of a run that succeeded
    spec, out, finalized = write_spec(tmp_path / "spec.yaml", training={"steps": 1}), tmp_path / "out", tmp_path / "fin"
    code = (f"import atexit, sys; atexit.register(lambda: open({str(finalized)!r}, 'w').close()); "
            f"from kiln.cli.main import main; sys.exit(main(['train', '--config', {str(spec)!r}, '--output', "
            f"{str(out)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], env=env(MASTER_PORT=str(free_port())), capture_output=True,
                          text=True, timeout=SAFETY_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1]  # trained, its records written before it left
    assert not finalized.exists()  # atexit handlers run in finalization: it was skipped


def test_eval_reads_where_kiln_run_saved(tmp_path):
    local = load_file(SAMPLES / "quickstart.yaml")[0]  # no checkpoint.uri: kiln run saves under --output
    assert eval_checkpoint_uri(local, output=str(tmp_path), checkpoint=None) == f"file://{tmp_path}/checkpoints"
    assert eval_checkpoint_uri(local, output=None, checkpoint=None).endswith("/runs/quickstart/checkpoints")
    store = load_file(SAMPLES / "gpu-single-node.yaml")[0]  # checkpoint.uri: kiln run saves there, whatever --output
    assert eval_checkpoint_uri(store, output=str(tmp_path), checkpoint=None) == "s3://checkpoints/llama-1b-single-node/"
    assert eval_checkpoint_uri(store, output=None, checkpoint="file:///elsewhere/") == "file:///elsewhere/"


@pytest.mark.slow
def test_the_replica_group_entry_reports_a_bad_spec_as_kiln_train_does(tmp_path, capsys):
    # tests/distributed/ft_group_entry.py is `kiln train` with hooks: a bad spec must be the CLI's one-line error
    # and exit code, as `kiln train` gives, not a traceback.
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 3, "warmupSteps": 10})
    args = ["--config", str(spec), "--output", str(tmp_path / "out")]
    code = main(["train", *args])
    said = capsys.readouterr().err
    gate = tmp_path / "gate"
    gate.write_text("")  # a plain file: the entry's wait on its gate returns at once
    entry = Path(__file__).resolve().parents[1] / "distributed" / "ft_group_entry.py"
    group = subprocess.run([sys.executable, str(entry), *args], env=env(KILN_TEST_GATE=str(gate)),
                           capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S, check=False)
    assert (group.returncode, group.stderr) == (code, said) == (1, said)
    (line,) = said.splitlines()
    assert line.startswith(f"kiln: error: {spec}: ") and "warmupSteps" in line, line
