"""A replica group's worker for the fault-tolerance tests: `kiln train`, started by torchrun, held at a gate.

torchrun runs this file instead of `-m kiln.cli.main`: it imports everything first (torch, torchft, the
trainer: seconds on a loaded machine), then opens the FIFO named by KILN_TEST_GATE (`.r` appended for local
rank r > 0: one per worker) and blocks until the test writes to it. The test knows the worker is ready when its open for writing returns, and releases it at the
step it chooses (a reported step, never a clock): a restarted group then rejoins within a step or two of the
release, and two groups released together start in the same quorum.

It is `kiln train` with one addition: hooks that append each run event the trainer raises (a restart from a
commit, a heal from a live peer, a quorum change; kiln.trainer.hooks) to events.jsonl in the output folder,
for the tests to check that each fires where its event happens. With KILN_TEST_SPIKES (a JSON list of
[live groups, from step]) it also stands in for bad data: series i replaces the global loss by a spike on
every step from its step on, taken with that many groups live, while the guards have rolled back i times;
the guards' default rollback (3 spikes) ends it. Keyed on the job's state (the guards' rollbacks, which a
healed group receives, and the quorum), so every group injects at the same steps, and a redone step is clean.
When a series needs more live groups than there are, the process stops itself (SIGSTOP, once) for the test
to bring the missing group to the lighthouse before it steps on (SIGCONT). With KILN_TEST_HANG_AT=N the loop
hangs in step N (after the step's vote, before its optimizer step): a wait on an event that never comes, as a
stuck data read or a deadlock would; the group's hang watch (kiln.trainer.membership.hang_watch) must end the process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import sys
import threading
from pathlib import Path

import torch  # noqa: F401  the imports a start pays for, before the gate
import torchft  # noqa: F401

import kiln.trainer.membership.replica_groups  # noqa: F401
from kiln.cli.main import build_parser, run_command
from kiln.cli.rank_cmds import cmd_train
from kiln.trainer.loop import StepHooks


def event_log(out: Path) -> StepHooks:
    """StepHooks that log every run event to out/events.jsonl (the guards still install themselves)."""
    out.mkdir(parents=True, exist_ok=True)

    def log(kind: str):
        def hook(event) -> None:
            if os.environ.get("RANK", "0") != "0":  # every rank of the group sees the event: log it once
                return
            with (out / "events.jsonl").open("a") as f:
                f.write(json.dumps({"event": kind, **dataclasses.asdict(event)}) + "\n")
        return hook

    hooks = StepHooks(on_restart=[log("restart")], on_heal=[log("heal")],
                      on_membership_change=[log("membership_change")])
    spikes = json.loads(os.environ.get("KILN_TEST_SPIKES", "[]"))
    if spikes:
        from kiln.trainer.guards.hooks import GuardHooks

        guards = GuardHooks()

        held = []

        def inject(ctx) -> bool:
            done = guards.guard.counters.rollbacks
            if done < len(spikes):
                live, first = spikes[done]
                now = ctx.record.get("ft_participants")
                if now == live and ctx.step >= first:
                    ctx.loss = 50.0 + ctx.step  # the global loss every rank of every live group sees
                elif now < live and done and not held:  # the next series needs a group that is not here:
                    held.append(ctx.step)  # stop (once) until the test has brought it to the lighthouse
                    os.kill(os.getpid(), signal.SIGSTOP)
            return True

        hooks.before_update.append(inject)  # before the guards' own check
        guards.install(hooks)
    if hang_at := int(os.environ.get("KILN_TEST_HANG_AT", "0")):
        def hang(ctx) -> bool:
            if ctx.step == hang_at:
                threading.Event().wait()  # never set
            return True

        hooks.before_update.insert(0, hang)
        if not spikes:  # setup installs the guards only when no step hook is given
            from kiln.trainer.guards.hooks import GuardHooks

            GuardHooks().install(hooks)
    return hooks


def gate_path() -> str:
    """This worker's gate (tests/distributed/ft_helpers.Group): KILN_TEST_GATE for local rank 0, `.r` after it
    for local rank r."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    return os.environ["KILN_TEST_GATE"] + (f".{rank}" if rank else "")


if __name__ == "__main__":
    with open(gate_path()) as gate:
        gate.read()
    args = build_parser().parse_args(["train", *sys.argv[1:]])
    # through the CLI's error handling, as `kiln train`: a bad spec is one line and exit 1, not a traceback
    sys.exit(run_command(functools.partial(cmd_train, hooks=event_log(Path(args.output))), args))
