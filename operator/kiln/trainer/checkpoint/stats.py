"""What the Checkpointer's parts share, made explicit: `CheckpointStats` (the measurements and counters the save
writes, the restore sets, the schedule and the status read) and `Ranks` (this rank, the world and the gloo group
the checkpoint collectives run on). kiln.trainer.checkpoint.checkpointer composes the parts around them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass
class CheckpointStats:
    last_saved_step: int | None = None  # staged (maybe still uploading)
    last_committed_step: int | None = None
    last_commit_time: float | None = None
    last_blocking_s: float = 0.0  # the loop blocked to stage the last save
    last_wait_s: float = 0.0  # the last save waited this long for the one before it
    last_save_s: float = 0.0  # staging to COMMIT, wall time
    save_failures: int = 0
    run_seconds: float = 0.0  # training wall time of the processes before this one, carried in trainer.json
    failures: int = 0  # restarts that did not end in a final save, carried in trainer.json
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        """This process's seconds so far."""
        return time.monotonic() - self.started

    def book(self) -> dict:
        """What a commit carries for the next process (under "kiln"/"checkpoint")."""
        return {"run_seconds": self.run_seconds + self.elapsed(), "failures": self.failures}

    def restored(self, step: int, meta: dict) -> None:
        """Resumed from the commit of `step`, whose "kiln" entry is `meta`."""
        book = meta.get("checkpoint", {})
        self.run_seconds = float(book.get("run_seconds", 0.0))
        # a restart from a non-final checkpoint means the previous process died: count it for the MTBF
        self.failures = int(book.get("failures", 0)) + (0 if meta.get("final") else 1)
        self.last_saved_step = self.last_committed_step = step


@dataclass
class Ranks:
    """This rank in the checkpoint's world; `pg` is a gloo group of its own (the collectives of a background save
    never interleave with the loop's on the default group, and work under NCCL too)."""

    rank: int
    world_size: int
    distributed: bool = False
    pg: object = None

    @classmethod
    def join(cls, rank: int, world_size: int) -> Ranks:
        distributed = dist.is_available() and dist.is_initialized() and world_size > 1
        return cls(rank, world_size, distributed, dist.new_group(backend="gloo") if distributed else None)

    def bcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order."""
        if not self.distributed:
            return [obj]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, obj, group=self.pg)
        return everyone
