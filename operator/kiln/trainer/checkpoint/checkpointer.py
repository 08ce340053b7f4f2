"""Asynchronous, atomic checkpoints that any world size can resume (DESIGN.md §4, docs/checkpoints.md).

Model and optimizer state go through `torch.distributed.checkpoint` (DCP) as sharded, FQN-keyed state dicts
from `get_state_dict`, so a checkpoint saved with one parallel layout loads into any other (DCP reshards).
DCP's FileSystemWriter/Reader do the (de)serialisation; their file system is swapped for one over a kiln
ObjectStore (kiln.trainer.checkpoint.dcp_store): each shard is hashed as DCP writes it and streamed into the store as a
multipart upload whose parts go up while the rest is serialised (each part retried on its own); on file:// it is
written in place. Restore reads each file once: every rank downloads its share (the shards it wrote), checks
size and sha256 against COMMIT, and DCP loads those very bytes; a damaged commit falls back to the previous one.

A save blocks the training loop only to copy the state off the accelerator (into reused pinned host buffers on
GPU, a CPU copy on CPU); the upload, the COMMIT (rank 0, after every rank's file list with sizes and sha256s
is gathered) and retention run in one background thread on a separate gloo process group. At most one save
is in flight; the next one waits for it and says how long it waited.

Preemption: call `install_sigterm_handler()` once, and in the loop `if ckpt.stop_requested(step):
ckpt.save(step, ..., final=True); break` — every rank agrees on the same step before saving.

The parts, one module each, which the Checkpointer class combines: checkpoint_interval (when to save,
intervalSteps auto), checkpoint_save, checkpoint_restore, checkpoint_preemption (SIGTERM, the agreed
stop) and checkpoint_state (the state dicts of several model parts).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from kiln.api.spec import CheckpointSpec
from kiln.errors import KilnError
from kiln.storage import ObjectStore, open_store
from kiln.storage.commit import step_dir
from kiln.trainer.checkpoint.interval import (  # noqa: F401  (imported from here by tests and the CLI)
    AUTO_FIRST_STEPS,
    AUTO_MAX_STEPS,
    AUTO_MIN_STEPS,
    MTBF_PRIOR_S,
    CheckpointInterval,
)
from kiln.trainer.checkpoint.preemption import (  # noqa: F401
    CheckpointPreemption,
    _sigterm,
    install_sigterm_handler,
    sigterm_received,
)
from kiln.trainer.checkpoint.restore import CheckpointRestore, memory_available  # noqa: F401
from kiln.trainer.checkpoint.save import CheckpointSave
from kiln.trainer.checkpoint.state import STATE_OPTIONS, _pairs, collect_state  # noqa: F401
from kiln.trainer.checkpoint.host_copy import shm_dir


# -- the checkpointer ------------------------------------------------------------------------------------------


class Checkpointer(CheckpointInterval, CheckpointPreemption, CheckpointSave, CheckpointRestore):
    """Save/restore model, optimizer and trainer state under `spec.uri` (or `default_uri`)."""

    def __init__(
        self,
        spec: CheckpointSpec,
        *,
        default_uri: str,
        rank: int,
        world_size: int,
        store: ObjectStore | None = None,
        thread_count: int = 2,
        stop_check_every: int = 10,
    ):
        self.spec = spec
        self.uri = spec.uri or default_uri
        if not self.uri:
            raise KilnError(
                "checkpoint.uri is not set and there is no default; set it to s3://bucket/prefix/ or file:///path/"
            )
        self.rank, self.world_size = rank, world_size
        self.store = store or open_store(self.uri, endpoint=spec.endpoint)
        self.thread_count = thread_count
        self.stop_check_every = max(1, stop_check_every)
        self._distributed = dist.is_available() and dist.is_initialized() and world_size > 1
        # DCP's collectives run in the background thread: give them their own gloo group, so they never
        # interleave with the training loop's collectives on the default group (and work under NCCL too).
        self._pg = dist.new_group(backend="gloo") if self._distributed else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kiln-ckpt")
        self._shm = shm_dir(self.uri, rank)
        self.last_restore_source: str | None = None  # "memory" or the store's URI, after restore()
        self._future: Future | None = None
        self._cache: dict | None = None
        self._cache_sig: Any = None
        self._pin = torch.cuda.is_available()
        self.last_saved_step: int | None = None
        self.last_committed_step: int | None = None
        self.last_commit_time: float | None = None
        # measurements for intervalSteps: auto and for metrics
        self.last_blocking_s = 0.0
        self.last_wait_s = 0.0
        self.last_save_s = 0.0  # staging to COMMIT, wall time
        self.save_failures = 0
        self._step_time_s: float | None = None
        self._last_step_seen: tuple[int, float] | None = None
        self._run_seconds = 0.0  # training wall time over the whole run, carried in trainer.json
        self._failures = 0  # restarts that did not end in a final save, carried in trainer.json
        self._started = time.monotonic()


    # -- status ------------------------------------------------------------------------------------------------

    def status(self) -> dict:
        """For metrics and the TrainingSpec status (lastCheckpoint)."""
        out = {
            "intervalSteps": self.interval_steps,
            "blockingSeconds": self.last_blocking_s,
            "waitSeconds": self.last_wait_s,
            "saveSeconds": self.last_save_s,
            "saveFailures": self.save_failures,
        }
        if self.last_committed_step is not None:
            out["lastCheckpoint"] = {
                "step": self.last_committed_step,
                "uri": self.store.url(step_dir(self.last_committed_step)) + "/",
                "time": self.last_commit_time,
            }
        return out
