"""`kiln torchrun` (torchrun, exiting 128+N when stopped by signal N) and `kiln train` (one rank under it)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from kiln.api.load import load_one, parse
from kiln.cli.local_run import shorten
from kiln.errors import KilnError


def cmd_torchrun(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from kiln.cli.failure import cause, write_cause

    try:
        torchrun_main(args.torchrun_args)
    except ChildFailedError as err:  # the failed ranks' error files: the cause is the last line, not a traceback
        found = cause(err.failures)
        if write_cause(found):
            return 1
        raise KilnError(found.line) from None
    except SignalException as err:
        # torchrun forwarded the signal to the ranks, which saved; it then raises, and Python exits 1, which
        # PyTorchJob's ExitCode policy counts as a permanent failure: one deleted pod failed the whole run.
        signum = int(err.sigval)
        print(f"kiln: torchrun stopped by signal {signum}; exiting {128 + signum} (retryable)", file=sys.stderr,
              flush=True)
        return 128 + signum
    return 0


def cmd_train(args: argparse.Namespace, hooks=None) -> int:
    """One rank of `kiln train`; `hooks` (kiln.trainer.hooks.StepHooks, None: the guards) for callers in Python.
    A run that returns ends the process here (`leave`); an error returns through the CLI's handling."""
    from kiln.trainer.checkpoint.checkpointer import sigterm_received
    from kiln.trainer.loop import train

    doc = load_one(args.config)
    if args.steps is not None:
        if args.steps < 1:
            raise KilnError(f"--steps must be at least 1, not {args.steps}")
        data = doc.model_dump(by_alias=True, exclude_none=True, mode="json")
        note = shorten(data["spec"]["training"], args.steps)
        doc = parse(data, args.config)
        if note and os.environ.get("RANK", "0") == "0":
            print(note, flush=True)
    output = Path(args.output or f"runs/{doc.metadata.name}")
    from kiln.cli.failure import record_rank_failure, tracebacks_to_file

    tracebacks_to_file(os.environ.get("RANK", "0"))
    try:
        result = train(doc, output_dir=output, hooks=hooks)
    except KeyboardInterrupt:
        return 130  # the launcher reports the interruption once
    except Exception as err:  # noqa: BLE001 - recorded for torchrun, which tells the launcher which rank failed why
        raise record_rank_failure(err, os.environ.get("RANK", "0")) from None
    leave(stop_exit_code(result.final_step, doc.spec.training.steps, signalled=sigterm_received()))


def leave(code: int) -> None:
    """End this rank's process now, with `code`, once the run is closed (checkpoint committed, files closed,
    the process group left): without interpreter finalization, where gloo's worker threads can still hold
    tensors and freeing them aborts the process ("terminate called without an active exception", SIGABRT;
    pytorch#179291). A finished run's rank then exited -6, torchrun reported the rank failed, and the
    PyTorchJob counted a failure of a run that had succeeded (seen on a loaded CI run, a replica group at TP 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for report in before_leaving:
        report(code)
    os._exit(code)


# Called with the exit code just before `leave` ends the process: a warm-started rank reports it to its
# launcher here (kiln.cli.warm), which exits with it.
before_leaving: list = []


def stop_exit_code(final_step: int, steps: int, *, signalled: bool) -> int:
    """A rank's exit code. 0: the run finished, or this process was stopped (SIGTERM) and saved: its
    launcher, stopped too, reports that. A rank that saved and stopped early because *another* rank was
    stopped (a peer pod deleted) exits 143 instead: 0 would tell torchrun, and so the PyTorchJob, that the run
    is done (an elastic job succeeds when one worker does), while it must restart its group and go on."""
    if final_step >= steps or signalled:
        return 0
    return 128 + signal.SIGTERM
