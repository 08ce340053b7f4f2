"""`kiln train` with one slow rank, for tests/distributed/test_slow_rank.py: started by torchrun in place of
`-m kiln.cli.main train`. The rank KILN_TEST_SLOW_RANK does more work than the others, never a sleep:
KILN_TEST_SLOW_PROBE=k makes its pre-flight matmul k matmuls (kiln.trainer.observe.preflight times one), and
KILN_TEST_SLOW_STEP=k adds k 384 x 384 matmuls to each of its steps (after its backward, before the optimizer
step), as a slower CPU or a data pipeline with more to do would."""

from __future__ import annotations

import functools
import os
import sys

import torch

from kiln.cli.main import build_parser, run_command
from kiln.cli.rank_cmds import cmd_train
from kiln.trainer.guards.hooks import GuardHooks
from kiln.trainer.loop import StepHooks


def slow_hooks() -> StepHooks:
    slow = int(os.environ["RANK"]) == int(os.environ["KILN_TEST_SLOW_RANK"])
    probe_work, step_work = (int(os.environ.get(k, "0")) if slow else 0
                             for k in ("KILN_TEST_SLOW_PROBE", "KILN_TEST_SLOW_STEP"))
    a = torch.randn(384, 384)

    def heavier_matmul(x, y):
        for _ in range(probe_work - 1):
            torch.matmul(x, y)
        return torch.matmul(x, y)

    def extra_work(ctx) -> bool:
        for _ in range(step_work):
            torch.mm(a, a)
        return True

    hooks = StepHooks(before_update=[extra_work], preflight_matmul=heavier_matmul if probe_work > 1 else None)
    GuardHooks().install(hooks)  # setup installs the guards only when no hooks are given
    return hooks


if __name__ == "__main__":
    args = build_parser().parse_args(["train", *sys.argv[1:]])
    sys.exit(run_command(functools.partial(cmd_train, hooks=slow_hooks()), args))
