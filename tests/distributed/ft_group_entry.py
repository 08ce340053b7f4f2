"""A replica group's worker for the fault-tolerance tests: `kiln train`, started by torchrun, held at a gate.

torchrun runs this file instead of `-m kiln.cli.main`: it imports everything first (torch, torchft, the
trainer: seconds on a loaded machine), then opens the FIFO named by KILN_TEST_GATE and blocks until the test
writes to it. The test knows the worker is ready when its open for writing returns, and releases it at the
step it chooses (a reported step, never a clock): a restarted group then rejoins within a step or two of the
release, and two groups released together start in the same quorum.
"""

from __future__ import annotations

import os
import sys

import torch  # noqa: F401  the imports a start pays for, before the gate
import torchft  # noqa: F401

import kiln.trainer.ft  # noqa: F401
import kiln.trainer.loop  # noqa: F401
from kiln.cli.main import main

if __name__ == "__main__":
    with open(os.environ["KILN_TEST_GATE"]) as gate:
        gate.read()
    sys.exit(main(["train", *sys.argv[1:]]))
