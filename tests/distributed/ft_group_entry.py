"""A replica group's worker for the fault-tolerance tests: `kiln train`, started by torchrun, held at a gate.

torchrun runs this file instead of `-m kiln.cli.main`: it imports everything first (torch, torchft, the
trainer: seconds on a loaded machine), then opens the FIFO named by KILN_TEST_GATE and blocks until the test
writes to it. The test knows the worker is ready when its open for writing returns, and releases it at the
step it chooses (a reported step, never a clock): a restarted group then rejoins within a step or two of the
release, and two groups released together start in the same quorum.

It is `kiln train` with one addition: hooks that append each run event the trainer raises (a restart from a
commit, a heal from a live peer, a quorum change; kiln.trainer.hooks) to events.jsonl in the output folder,
for the tests to check that each fires where its event happens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import torch  # noqa: F401  the imports a start pays for, before the gate
import torchft  # noqa: F401

import kiln.trainer.ft  # noqa: F401
from kiln.cli.main import build_parser, run_command
from kiln.cli.train_cmds import cmd_train
from kiln.trainer.loop import StepHooks


def event_log(out: Path) -> StepHooks:
    """StepHooks that log every run event to out/events.jsonl (the guards still install themselves)."""
    out.mkdir(parents=True, exist_ok=True)

    def log(kind: str):
        def hook(event) -> None:
            with (out / "events.jsonl").open("a") as f:
                f.write(json.dumps({"event": kind, **dataclasses.asdict(event)}) + "\n")
        return hook

    return StepHooks(on_restart=[log("restart")], on_heal=[log("heal")],
                     on_membership_change=[log("membership_change")])


if __name__ == "__main__":
    with open(os.environ["KILN_TEST_GATE"]) as gate:
        gate.read()
    args = build_parser().parse_args(["train", *sys.argv[1:]])
    # through the CLI's error handling, as `kiln train`: a bad spec is one line and exit 1, not a traceback
    sys.exit(run_command(functools.partial(cmd_train, hooks=event_log(Path(args.output))), args))
