"""`kiln train` with one rank that hangs, for tests/distributed/test_hang_report.py: started by torchrun in place
of `-m kiln.cli.main train`. With KILN_TEST_HANG_AT=N the rank KILN_TEST_HANG_RANK waits in step N (after its
backward, before its optimizer step) on an event that never comes, as a stuck data read or a deadlock would; the
other ranks go on into the next step's collectives and wait there for it."""

from __future__ import annotations

import functools
import os
import sys
import threading

from kiln.cli.main import build_parser, run_command
from kiln.cli.rank_cmds import cmd_train
from kiln.trainer.guards.hooks import GuardHooks
from kiln.trainer.loop import StepHooks


def hanging_hooks() -> StepHooks:
    hang_at, hang_rank = int(os.environ["KILN_TEST_HANG_AT"]), int(os.environ["KILN_TEST_HANG_RANK"])

    def hang(ctx) -> bool:
        if ctx.step == hang_at and int(os.environ["RANK"]) == hang_rank:
            threading.Event().wait()  # never set
        return True

    hooks = StepHooks(before_update=[hang])
    GuardHooks().install(hooks)  # setup installs the guards only when no hooks are given
    return hooks


if __name__ == "__main__":
    args = build_parser().parse_args(["train", *sys.argv[1:]])
    sys.exit(run_command(functools.partial(cmd_train, hooks=hanging_hooks()), args))
