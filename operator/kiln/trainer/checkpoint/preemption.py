"""Preemption: SIGTERM becomes a flag, and every rank agrees on the step to save and stop at
(kiln.trainer.checkpoint.checkpointer)."""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist

from kiln.trainer.checkpoint.stats import Ranks

log = logging.getLogger("kiln.checkpoint")

_sigterm = threading.Event()


def sigterm_received() -> bool:
    """Whether this process itself got SIGTERM (as opposed to stopping because another rank did)."""
    return _sigterm.is_set()


def install_sigterm_handler() -> threading.Event:
    """Turn SIGTERM (pod eviction, preemption, `kubectl delete`) into a flag instead of an exit.

    Call once from the main thread; the loop then checks `Checkpointer.stop_requested(step)` and, when it says
    so, saves with final=True and exits normally. Kubernetes sends SIGKILL after terminationGracePeriodSeconds,
    so that grace period must cover one staging plus one upload.
    """

    def handler(signum, frame):
        log.warning("SIGTERM received: will save a checkpoint and stop at the next agreed step")
        _sigterm.set()

    signal.signal(signal.SIGTERM, handler)
    return _sigterm


class Preemption:
    """The Checkpointer's side of preemption: every rank agrees on the step to stop at."""

    def __init__(self, ranks: Ranks, check_every: int):
        self.ranks, self.check_every = ranks, max(1, check_every)

    def stop_requested(self, step: int) -> bool:
        """True on every rank at the same step once any rank got SIGTERM (checked every `check_every` steps)."""
        if not self.ranks.distributed:
            return _sigterm.is_set()
        if step % self.check_every:
            return False
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        flag = torch.tensor([1.0 if _sigterm.is_set() else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
