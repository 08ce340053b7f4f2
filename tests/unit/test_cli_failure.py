"""The cause on the last line, without processes (issue 28): the rank's record in torchrun's error file, read back by
torch's own ProcessFailure; the cause chosen among several failed ranks; an unexpected exception as one line."""

from __future__ import annotations

import signal
import tempfile

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from kiln.cli.failure import TRACEBACKS_ENV, cause, record_rank_failure
from kiln.cli.main import main
from kiln.errors import KilnError, Unavailable
from tests.support.runs import write_spec


def failed_rank(tmp_path, monkeypatch, rank: int, err: BaseException, when: float) -> ProcessFailure:
    """A rank that raised `err` at time `when`, as torchrun sees it: torch parses the error file it left."""
    path = tmp_path / f"error-{rank}.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv(TRACEBACKS_ENV, str(tmp_path / "logs"))
    monkeypatch.setattr("time.time", lambda: when)
    try:
        raise err
    except BaseException as raised:  # noqa: BLE001 - recorded as a rank does
        record_rank_failure(raised, str(rank))
    monkeypatch.undo()
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))


def test_the_cause_is_the_error_kiln_stated_not_the_knock_on_failures(tmp_path, monkeypatch):
    # rank 0 fails first, only because rank 1 left the collective; rank 1 says why
    gloo = failed_rank(tmp_path, monkeypatch, 0, RuntimeError("[gloo] Connection closed by peer"), 1000.1)
    refusal = failed_rank(tmp_path, monkeypatch, 1, KilnError("checkpoint step 2: refused"), 1000.7)
    killed = ProcessFailure(local_rank=2, pid=102, exitcode=-signal.SIGTERM, error_file="<N/A>")
    found = cause({0: gloo, 1: refusal, 2: killed})
    assert (found.line, found.retryable) == ("rank 1: checkpoint step 2: refused", False)
    # without a statement, the earliest exception: its one line names the file holding its traceback
    found = cause({0: gloo, 2: killed})
    (saved,) = (tmp_path / "logs").glob("rank-0.traceback")
    assert found.line == f"rank 0: RuntimeError: [gloo] Connection closed by peer (traceback in {saved}; " \
                         f"--debug prints it)" and not found.retryable
    assert "RuntimeError" in saved.read_text()


def test_only_a_failure_that_may_pass_is_worth_a_rerun(tmp_path, monkeypatch):
    away = failed_rank(tmp_path, monkeypatch, 0, Unavailable("s3: still failing; is the server up?"), 5.0)
    assert cause({0: away}).retryable
    assert cause({0: away}).advice("rerunning resumes") == "rank 0: s3: still failing; is the server up?; " \
                                                           "rerunning resumes"
    oom = ProcessFailure(local_rank=3, pid=7, exitcode=-signal.SIGKILL, error_file="<N/A>")
    found = cause({3: oom})
    assert found.line == "rank 3 was killed by SIGKILL (the kernel's out-of-memory killer sends it)" and found.retryable


def test_an_unexpected_exception_is_one_line_naming_its_traceback_file(tmp_path, capsys, monkeypatch):
    """Anything kiln did not expect is one line naming the exception and the file holding its traceback;
    --debug raises it (Python prints the traceback) instead."""
    from kiln.cli import train_cmds

    def boom(args):
        raise ZeroDivisionError("division by zero in a library")

    monkeypatch.setattr(train_cmds, "cmd_export", boom)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spec = write_spec(tmp_path / "spec.yaml")
    args = ["export", str(spec), "--output", (tmp_path / "hf").as_uri()]
    assert main(args) == 1
    err = capsys.readouterr().err
    (saved,) = tmp_path.glob("kiln-*-export.traceback")
    assert err.strip().splitlines()[-1] == (f"kiln: error: ZeroDivisionError: division by zero in a library "
                                            f"(traceback in {saved}; --debug prints it)")
    assert "Traceback" not in err and "in boom" in saved.read_text()
    with pytest.raises(ZeroDivisionError):
        main([*args, "--debug"])
