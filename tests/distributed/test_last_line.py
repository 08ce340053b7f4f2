"""The cause on the last line (issue 28): a failing `kiln run` (real torchrun ranks), `kiln eval` and `kiln export`
end with one line that is the failing rank's own error, advising a rerun only where one can help, with no
traceback on the console, for the hostile cases: a tampered checkpoint, a checkpoint of another model, missing
shards, an unreachable S3 endpoint."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli.main import main
from tests.forged_checkpoints import RunsCommand, forge, metadata_with
from tests.support.ranks import SAFETY_TIMEOUT_S
from tests.support.runs import MICRO_MODEL, env, write_spec

RERUN = "rerunning resumes"


def closed_port() -> int:
    """A local port nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A `kiln run` folder with one committed step (2) saved by 2 ranks."""
    out = tmp_path_factory.mktemp("last-line") / "base"
    spec = write_spec(out.parent / "spec.yaml", nproc=2, training={"steps": 2})
    proc = kiln_run(spec, out, "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def kiln_run(spec: Path, out: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", "run", str(spec), "--output", str(out), *args],
                          env=env(**extra_env), capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S, check=False)


def hostile(case: str, base: Path, tmp: Path) -> tuple[Path, Path, dict, str, bool]:
    """(spec, run folder, env, what the last line says, whether it advises a rerun) for one hostile case."""
    out = tmp / "out"
    shutil.copytree(base, out)
    root = out / "checkpoints"
    spec = write_spec(tmp / "spec.yaml", nproc=2, training={"steps": 4})
    if case == "tampered checkpoint":
        forge(root, 2, {".metadata": metadata_with(root, 2, RunsCommand(tmp / "ran"))})
        return spec, out, {}, f"{root.as_uri()}/step-00000002/.metadata", False
    if case == "wrong base model":  # one process: any world size loads any commit, so 1 rank shows it as well
        spec = write_spec(tmp / "spec.yaml", nproc=1, training={"steps": 4}, model={**MICRO_MODEL, "dim": 128})
        return spec, out, {}, "does not fit this model", False
    if case == "missing shards":
        (root / "step-00000002" / "__1_0.distcp").unlink()
        return spec, out, {}, f"every committed checkpoint under {root.as_uri()} is damaged", False
    assert case == "unreachable S3"
    spec = write_spec(tmp / "spec.yaml", nproc=1, training={"steps": 4}, checkpoint={
        "uri": "s3://nowhere/run/", "endpoint": f"http://127.0.0.1:{closed_port()}"})
    return spec, out, {"KILN_STORE_RETRY_SECONDS": "0.5", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}, \
        "is the server up and reachable?", True


CASES = ["tampered checkpoint", "wrong base model", "missing shards", "unreachable S3"]


def assert_last_line(stderr: str, says: str, rerun: bool) -> None:
    last = stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("kiln: error: ") and says in last, stderr[-3000:]
    assert (RERUN in last or "rerun" in last) == rerun, last
    assert "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c for c in CASES if c != "wrong base model"])  # that one: eval/export below
def test_kiln_run_ends_with_the_failing_ranks_own_error(base, tmp_path, case):
    spec, out, extra, says, rerun = hostile(case, base, tmp_path)
    proc = kiln_run(spec, out, **extra)
    assert proc.returncode == 1
    assert_last_line(proc.stderr, says, rerun)
    assert proc.stderr.rstrip().splitlines()[-1].startswith("kiln: error: training failed: rank ")
    assert not (tmp_path / "ran").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.parametrize("case", CASES)
def test_kiln_eval_and_export_end_with_the_cause(base, tmp_path, capsys, monkeypatch, command, case):
    spec, out, extra, says, rerun = hostile(case, base, tmp_path)
    for k, v in extra.items():
        monkeypatch.setenv(k, v)
    where = ["--output", str(out)] if command == "eval" else ["--run-output", str(out)]
    args = ["eval", str(spec), *where, "--device", "cpu", "--batches", "1"] if command == "eval" else \
        ["export", str(spec), *where, "--output", (tmp_path / "hf").as_uri()]
    assert main(args) == 1
    assert_last_line(capsys.readouterr().err, says, rerun=False)  # nothing to resume: the error's own words


@pytest.mark.distributed
def test_kiln_run_again_says_which_commit_it_resumed_from(base, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(base, out)
    spec = write_spec(tmp_path / "spec.yaml", nproc=1, training={"steps": 3})
    proc = kiln_run(spec, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    resumed = next(i for i, line in enumerate(lines) if line.startswith("kiln: resumed from step 2 at "))
    assert re.fullmatch(rf"kiln: resumed from step 2 at {re.escape((out / 'checkpoints').as_uri())}/step-00000002 "
                        r"\(committed \d+[smh] ago\)", lines[resumed]), lines[resumed]
    assert any(line.startswith("step 3/3") for line in lines[resumed:])
    assert not any(line.startswith(("step 1/", "step 2/")) for line in lines)
