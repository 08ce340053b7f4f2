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

The parts, one module each, which the Checkpointer composes (it owns them; they share nothing but what it
hands them): interval.CheckpointSchedule (when to save, intervalSteps auto), save.CheckpointSave,
restore.CheckpointRestore, preemption.Preemption (SIGTERM, the agreed stop), around one explicit
stats.CheckpointStats (what the saves measured, what the restore set) and stats.Ranks (the world and the gloo
group of the checkpoint collectives); state.py holds the state dicts of several model parts.
"""

from __future__ import annotations

from kiln.api.spec import CheckpointSpec
from kiln.errors import KilnError
from kiln.storage import ObjectStore, open_store
from kiln.storage.commit import step_dir
from kiln.trainer.checkpoint.host_copy import shm_dir
from kiln.trainer.checkpoint.interval import (  # noqa: F401  (imported from here by tests and the CLI)
    AUTO_FIRST_STEPS,
    AUTO_MAX_STEPS,
    AUTO_MIN_STEPS,
    MTBF_PRIOR_S,
    CheckpointSchedule,
)
from kiln.trainer.checkpoint.preemption import (  # noqa: F401
    Preemption,
    _sigterm,
    install_sigterm_handler,
    sigterm_received,
)
from kiln.trainer.checkpoint.restore import CheckpointRestore, memory_available  # noqa: F401
from kiln.trainer.checkpoint.save import CheckpointSave
from kiln.trainer.checkpoint.state import STATE_OPTIONS, _pairs, collect_state  # noqa: F401
from kiln.trainer.checkpoint.stats import CheckpointStats, Ranks


# -- the checkpointer ------------------------------------------------------------------------------------------


class Checkpointer:
    """Save/restore model, optimizer and trainer state under `spec.uri` (or `default_uri`): the parts above,
    composed. `stats` is what they measured (for the status, metrics and intervalSteps: auto)."""

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
        self.store = store or open_store(self.uri, endpoint=spec.endpoint)
        self.stats = CheckpointStats()
        ranks = Ranks.join(rank, world_size)
        shm = shm_dir(self.uri, rank)
        self.schedule = CheckpointSchedule(spec, self.stats)
        self.saver = CheckpointSave(spec, self.store, ranks, self.stats, shm=shm, thread_count=thread_count)
        self.restorer = CheckpointRestore(self.store, ranks, self.stats, shm=shm)
        self.preemption = Preemption(ranks, stop_check_every)

    # -- what the run calls ----------------------------------------------------------------------------------

    def restore(self, model_parts, optimizers, check=None) -> dict | None:
        """The newest verified commit into the model parts and optimizers; its trainer state, or None. `check`
        may refuse a commit before any tensor loads (CheckpointRestore.restore)."""
        self.saver.wait()  # a save in flight commits first: it may be the newest
        return self.restorer.restore(model_parts, optimizers, check)

    def save(self, step: int, model_parts, optimizers, trainer_state: dict, *, final: bool = False) -> None:
        self.saver.save(step, model_parts, optimizers, trainer_state, final=final)

    def should_save(self, step: int) -> bool:
        return self.schedule.should_save(step)

    def stop_requested(self, step: int) -> bool:
        return self.preemption.stop_requested(step)

    def wait(self) -> None:
        self.saver.wait()

    def close(self) -> None:
        self.saver.close()

    @property
    def last_restore_source(self) -> str | None:
        return self.restorer.last_restore_source

    def resume_line(self, now: float | None = None) -> str:
        return self.restorer.resume_line(now)

    def status(self) -> dict:
        """For metrics and the TrainingSpec status (lastCheckpoint)."""
        st = self.stats
        out = {
            "intervalSteps": self.schedule.interval_steps,
            "blockingSeconds": st.last_blocking_s,
            "waitSeconds": st.last_wait_s,
            "saveSeconds": st.last_save_s,
            "saveFailures": st.save_failures,
        }
        if st.last_committed_step is not None:
            out["lastCheckpoint"] = {
                "step": st.last_committed_step,
                "uri": self.store.url(step_dir(st.last_committed_step)) + "/",
                "time": st.last_commit_time,
            }
        return out


class NoCheckpoints:
    """The Checkpointer interface when checkpointing is off: nothing to restore, nothing saved."""

    stats = CheckpointStats()

    def restore(self, model_parts, optimizers, check=None):
        return None

    def should_save(self, step: int) -> bool:
        return False

    def status(self) -> dict:
        return {}

    def stop_requested(self, step: int) -> bool:
        return False

    def save(self, *args, **kwargs) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass
