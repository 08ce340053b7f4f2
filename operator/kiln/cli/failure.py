"""The cause on the last line (issue 28): a failing `kiln run`, `kiln eval`, `kiln export` ends with one line that
says why, in the failing rank's own words, and advises a rerun only when one can help.

A rank records its failure in torchrun's error file (TORCHELASTIC_ERROR_FILE, the format of
torch.distributed.elastic.multiprocessing.errors.ErrorHandler, plus torch's `errorTraits.retryability`);
torchrun hands every failed rank's file back in its ChildFailedError, and `kiln torchrun` turns the one that
caused the failure into the last line (in a pod: the last line of its log) or, under `kiln run`, into a small
JSON file (FAILURE_FILE_ENV) that `kiln run` ends with. Library tracebacks go to a file (TRACEBACKS_ENV, a folder)
or, with --debug, to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

FAILURE_FILE_ENV = "KILN_FAILURE_FILE"  # set by `kiln run`: where `kiln torchrun` writes the cause
TRACEBACKS_ENV = "KILN_TRACEBACKS"  # set by `kiln run` without --debug: the folder for the ranks' tracebacks
KILN_CATEGORY = "kiln"  # errorTraits.category of a KilnError: a cause stated by kiln, not a symptom


@dataclass(frozen=True)
class Cause:
    line: str
    retryable: bool

    def advice(self, rerun: str) -> str:
        """The line, with `rerun` (what running again does) appended only when a rerun can help."""
        return f"{self.line}; {rerun}" if self.retryable else self.line


def first_line(err: BaseException) -> str:
    """`Type: message`'s first line, for an exception kiln did not expect."""
    text = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def save_traceback(err: BaseException, folder: Path | None, name: str) -> Path:
    """Write err's traceback to folder/name (default folder: the system's temporary one); returns the path."""
    text = "".join(traceback.format_exception(err))
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_text(text)
        return path
    fd, path = tempfile.mkstemp(prefix="kiln-", suffix=f"-{name}")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(path)


def unexpected(err: BaseException, *, folder: Path | None, name: str) -> KilnError:
    """A KilnError whose one line names an exception kiln did not expect and the file holding its traceback."""
    path = save_traceback(err, folder, name)
    return KilnError(f"{first_line(err)} (traceback in {path}; --debug prints it)")


def record_rank_failure(err: BaseException, rank: str) -> KilnError:
    """In a rank started by torchrun: the KilnError to exit with (a KilnError as it is; anything else as one line,
    its traceback saved under TRACEBACKS_ENV or, when that is unset, printed), written to torchrun's error file
    first. Only a KilnError that says so (kiln.errors.Unavailable) is worth a rerun: kiln cannot tell whether an
    exception it did not expect would pass."""
    folder = os.environ.get(TRACEBACKS_ENV)
    if isinstance(err, KilnError):
        out, category = err, KILN_CATEGORY
    elif folder:
        out, category = unexpected(err, folder=Path(folder), name=f"rank-{rank}.traceback"), "exception"
    else:  # in a pod: its log is the log file
        traceback.print_exception(err)
        out, category = KilnError(first_line(err)), "exception"
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        now = time.time()
        data = {"message": {"message": str(out), "extraInfo": {
                    "py_callstack": "".join(traceback.format_exception(err)), "timestamp": str(int(now))}},
                "errorTraits": {"category": category, "retryability": str(bool(out.retryable))},
                "kiln": {"time": now}}
        try:
            Path(path).write_text(json.dumps(data))
        except OSError:
            pass  # the rank's own line on stderr still says it
    return out


class _TracebacksToFile(logging.Formatter):
    """Log records as their message alone (as Python's last-resort handler prints them); a record's traceback
    (a library logging an exception it handled, e.g. DCP falling back to another metadata file) goes to `path`."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def format(self, record: logging.LogRecord) -> str:
        if not record.exc_info:
            return record.getMessage()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(f"{record.name}: {record.getMessage()}\n{self.formatException(record.exc_info)}\n\n")
        return f"{record.getMessage()} (traceback in {self.path})"


def tracebacks_to_file(rank: str) -> None:
    """In a rank under `kiln run` without --debug (TRACEBACKS_ENV set): warnings print as before, their
    tracebacks go to TRACEBACKS_ENV/rank-N.log."""
    folder = os.environ.get(TRACEBACKS_ENV)
    if not folder:
        return
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_TracebacksToFile(Path(folder) / f"rank-{rank}.log"))
    logging.getLogger().addHandler(handler)


def cause(failures: dict) -> Cause:
    """The cause among torchrun's failed ranks ({rank: ProcessFailure}): a failure kiln stated (a KilnError) before
    any other, then an exception, then a rank killed by a signal; earliest first within each."""

    def key(item):
        rank, f = item
        data = f.error_file_data if isinstance(f.error_file_data, dict) else {}
        category = (data.get("errorTraits") or {}).get("category")
        order = 0 if category == KILN_CATEGORY else 1 if category == "exception" else 2 if f.exitcode < 0 else 3
        return order, (data.get("kiln") or {}).get("time", f.timestamp), rank

    rank, f = min(failures.items(), key=key)
    data = f.error_file_data if isinstance(f.error_file_data, dict) else {}
    traits = data.get("errorTraits") or {}
    if traits.get("category") in (KILN_CATEGORY, "exception"):
        message = f.message["message"] if isinstance(f.message, dict) else str(f.message)
        return Cause(f"rank {rank}: {message}", traits.get("retryability") == "True")
    if f.exitcode < 0:
        name = _signal_name(-f.exitcode)
        why = " (the kernel's out-of-memory killer sends it)" if -f.exitcode == signal.SIGKILL else ""
        return Cause(f"rank {rank} was killed by {name}{why}", True)
    return Cause(f"rank {rank} exited with code {f.exitcode} without saying why; its output above may", False)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def write_cause(c: Cause) -> bool:
    """Under `kiln run` (FAILURE_FILE_ENV set): write the cause for it and return True; else False."""
    path = os.environ.get(FAILURE_FILE_ENV)
    if not path:
        return False
    Path(path).write_text(json.dumps({"line": c.line, "retryable": c.retryable}))
    return True


def read_cause(path: Path) -> Cause | None:
    """What `kiln torchrun` wrote (None: nothing, e.g. torchrun itself failed before any rank ran)."""
    try:
        data = json.loads(path.read_text())
        return Cause(str(data["line"]), bool(data["retryable"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
