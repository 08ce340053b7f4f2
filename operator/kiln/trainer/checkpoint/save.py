"""Saving a checkpoint: staging off the accelerator, upload and COMMIT in the background, retention
(kiln.trainer.checkpoint.checkpointer)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from kiln.api.spec import CheckpointSpec
from kiln.errors import KilnError
from kiln.storage import ObjectStore
from kiln.storage.commit import FileEntry, apply_retention, step_dir, write_commit
from kiln.trainer.checkpoint.dcp_store import StoreFS, StoreWriter
from kiln.trainer.checkpoint.host_copy import SHM_MANIFEST
from kiln.trainer.checkpoint.stats import CheckpointStats, Ranks
from kiln.trainer.state import ModelState

log = logging.getLogger("kiln.checkpoint")

def _signature(sd: Any) -> Any:
    """Structure, shapes and dtypes: when it changes, the staging buffers must be re-allocated."""
    if isinstance(sd, dict):
        return tuple((k, _signature(v)) for k, v in sd.items())
    if isinstance(sd, torch.Tensor):
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        return (tuple(sd.shape), tuple(local.shape), sd.dtype)
    return type(sd).__name__


class CheckpointSave:
    """The Checkpointer's saves: stage, upload and COMMIT in the background, keep a copy in host memory. At most
    one save is in flight (one background thread); `stats` gets what each save measured."""

    def __init__(self, spec: CheckpointSpec, store: ObjectStore, ranks: Ranks, stats: CheckpointStats, *,
                 shm: Path | None, thread_count: int):
        self.spec, self.store, self.ranks, self.stats = spec, store, ranks, stats
        self.shm, self.thread_count = shm, thread_count
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kiln-ckpt")
        self._future: Future | None = None
        self._cache: dict | None = None  # the reused host buffers, and the state's structure they fit
        self._cache_sig: Any = None
        self._pin = torch.cuda.is_available()

    def _stage(self, state: dict) -> dict:
        """Copy the state off the accelerator into reused host buffers (pinned on GPU); the loop blocks here."""
        sig = _signature(state)
        if self._cache is None or sig != self._cache_sig:
            self._cache = _create_cpu_state_dict(state, pin_memory=self._pin)
            self._cache_sig = sig
        staged = _copy_state_dict(state, self._cache, non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()
        return staged

    def save(self, step: int, model_parts, optimizers, trainer_state: dict, *, final: bool = False) -> None:
        """Save `step`: blocks to stage, then uploads and commits in the background (inline if final or
        async_save is off). A failed background save is logged and training continues from the last commit."""
        stats = self.stats
        self._wait(before_save=True)
        if step == stats.last_saved_step:
            return
        t0 = time.perf_counter()
        state = ModelState(model_parts, optimizers).state_dict()
        staged = self._stage(state)
        stats.last_blocking_s = time.perf_counter() - t0
        meta = {
            "step": step,
            "world_size": self.ranks.world_size,
            "final": final,
            "time": time.time(),
            "checkpoint": stats.book(),
        }
        payload = dict(trainer_state)
        payload["kiln"] = meta
        stats.last_saved_step = step
        if final or not self.spec.async_save:
            self._write(step, staged, payload, t0, raise_errors=True)
        else:
            self._future = self._executor.submit(self._write, step, staged, payload, t0, False)
        log.info("checkpoint step %d: staged in %.3fs%s", step, stats.last_blocking_s, "" if final else ", uploading")

    def _write(self, step: int, staged: dict, payload: dict, t0: float, raise_errors: bool) -> None:
        """Shards (every rank) → file lists gathered → trainer.json, COMMIT, latest, retention (rank 0).

        Every rank reaches every collective whatever fails where: DCP turns a failed write on any rank into
        an error on all ranks, and rank 0's commit outcome is broadcast, so no rank is left waiting."""
        prefix, ranks, stats = step_dir(step), self.ranks, self.stats
        keep = self.shm.with_name(self.shm.name + ".next") if self.shm is not None else None
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
        fs = StoreFS(self.store, keep_dir=keep)
        try:
            if ranks.rank == 0:
                try:
                    self.store.delete(f"{prefix}/COMMIT")  # a stale COMMIT from an older attempt at this step
                except Exception as err:  # noqa: BLE001 - the save goes on; a stale COMMIT fails verification
                    log.warning("checkpoint step %d: could not remove an old COMMIT: %s", step, err)
            writer = StoreWriter(
                fs, prefix, thread_count=self.thread_count, sync_files=self.store.local_path(prefix) is not None
            )
            dcp.save(staged, storage_writer=writer, process_group=ranks.pg, no_dist=not ranks.distributed)
            everyone = ranks.gather({key.split("/", 1)[1]: entry for key, entry in fs.written.items()})
            failure = None
            if ranks.rank == 0:
                try:
                    files: dict[str, FileEntry] = {}
                    for part in everyone:
                        files.update(part)
                    write_commit(self.store, step, files, payload)
                    deleted = apply_retention(self.store, self.spec.keep, current=step)
                    if deleted:
                        log.info("checkpoint retention (keep %d): deleted steps %s", self.spec.keep, deleted)
                except Exception as err:  # noqa: BLE001 - reported on every rank below
                    failure = f"commit by rank 0 failed: {err}"
            failure = ranks.bcast(failure)  # every rank learns whether the step is committed
            if failure:
                raise RuntimeError(failure)
            stats.last_committed_step = step
            stats.last_commit_time = time.time()
            self._keep_in_memory(step, fs, keep)
            stats.last_save_s = time.perf_counter() - t0
            if ranks.rank == 0:
                log.info("checkpoint step %d committed to %s in %.2fs", step, self.store.url(prefix), stats.last_save_s)
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            stats.save_failures += 1
            msg = (
                f"checkpoint step {step} to {self.store.url(prefix)} failed: {err}; "
                f"the last committed step ({stats.last_committed_step}) stays the one to resume from"
            )
            if raise_errors:
                raise KilnError(msg) from err
            log.error(msg)
        finally:
            if keep is not None:
                shutil.rmtree(keep, ignore_errors=True)

    def _keep_in_memory(self, step: int, fs: StoreFS, keep: Path | None) -> None:
        """Make this rank's files of the just-committed `step` its host-memory copy, replacing the older one
        (only the newest step is kept). Staged uploads were moved to `keep` already; in-place (file://)
        shards are copied. A failure here costs only the fast restart."""
        if keep is None:
            return
        try:
            keep.mkdir(parents=True, exist_ok=True)
            for key in fs.written:
                local, name = self.store.local_path(key), key.rsplit("/", 1)[-1]
                if local is not None and name.endswith(".distcp"):
                    shutil.copyfile(local, keep / name)
            manifest = {"step": step, "world_size": self.ranks.world_size, "rank": self.ranks.rank}
            (keep / SHM_MANIFEST).write_text(json.dumps(manifest) + "\n")
            shutil.rmtree(self.shm, ignore_errors=True)
            os.replace(keep, self.shm)
        except OSError as err:
            log.warning("checkpoint step %d: no host-memory copy in %s (%s); restarts read the store", step, keep, err)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed (or has failed and been logged)."""
        self._wait(before_save=False)

    def _wait(self, before_save: bool) -> None:
        if self._future is None:
            self.stats.last_wait_s = 0.0
            return
        t0 = time.perf_counter()
        done = self._future.done()
        self._future.result()
        self._future = None
        self.stats.last_wait_s = time.perf_counter() - t0 if before_save else 0.0
        if before_save and not done and self.stats.last_wait_s > 0.01:
            log.warning(
                "checkpoint: waited %.2fs for the previous save to finish (the store is slower than the interval)",
                self.stats.last_wait_s,
            )

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
        self._cache = None
