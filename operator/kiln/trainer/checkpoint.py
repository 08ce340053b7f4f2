"""Asynchronous, atomic checkpoints that any world size can resume (DESIGN.md §4, docs/checkpoints.md).

Model and optimizer state go through `torch.distributed.checkpoint` (DCP) as sharded, FQN-keyed state dicts
from `get_state_dict`, so a checkpoint saved with one parallel layout loads into any other (DCP reshards).
DCP's FileSystemWriter/Reader do the (de)serialisation; their file system is swapped for one over a kiln
ObjectStore (kiln.trainer.dcp_store): each shard is hashed as DCP writes it and streamed into the store as a
multipart upload whose parts go up while the rest is serialised (each part retried on its own); on file:// it is
written in place. Restore reads each file once: every rank downloads its share (the shards it wrote), checks
size and sha256 against COMMIT, and DCP loads those very bytes; a damaged commit falls back to the previous one.

A save blocks the training loop only to copy the state off the accelerator (into reused pinned host buffers on
GPU, a CPU copy on CPU); the upload, the COMMIT (rank 0, after every rank's file list with sizes and sha256s
is gathered) and retention run in one background thread on a separate gloo process group. At most one save
is in flight; the next one waits for it and says how long it waited.

Preemption: call `install_sigterm_handler()` once, and in the loop `if ckpt.stop_requested(step):
ckpt.save(step, ..., final=True); break` — every rank agrees on the same step before saving.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

from kiln.api.spec import CheckpointSpec
from kiln.errors import KilnError
from kiln.storage import ObjectStore, open_store
from kiln.storage.commit import (
    FileEntry,
    apply_retention,
    committed_steps,
    fetch_verified,
    read_commit,
    read_latest,
    read_trainer_state,
    step_dir,
    verify_files,
    write_commit,
    young_daly_interval,
)
from kiln.trainer.dcp_store import SafeLoadPlanner, StoreFS, StoreReader, StoreWriter, UnsafeCheckpoint
from kiln.trainer.shm_copy import SHM_MANIFEST, read_shm_copy, shm_dir

log = logging.getLogger("kiln.checkpoint")

_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's shard names: __<rank>_<n>.distcp
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # FQN keys: mergeable over pipeline stages

# intervalSteps: auto — bounds and priors (Young/Daly needs a cost and an MTBF before it has measured either).
AUTO_MIN_STEPS = 10
AUTO_MAX_STEPS = 10_000
AUTO_FIRST_STEPS = 10  # first save early, to measure its cost
MTBF_PRIOR_S = float(os.environ.get("KILN_MTBF_PRIOR_SECONDS", 6 * 3600))  # one failure per this, before evidence


# -- state dicts of several model parts (pipeline stages) ------------------------------------------------------


def _pairs(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> list[tuple[nn.Module, list[Optimizer]]]:
    if len(model_parts) == 1:
        return [(model_parts[0], list(optimizers))]
    if len(optimizers) == len(model_parts):
        return [(m, [o]) for m, o in zip(model_parts, optimizers)]
    raise KilnError(
        f"checkpoint: {len(model_parts)} model parts need one optimizer each (got {len(optimizers)} optimizers)"
    )


def collect_state(model_parts, optimizers) -> tuple[dict[str, Any], list[tuple[set[str], set[str]]]]:
    """{"model": {...}, "optim": {...}} merged over parts, and each part's key sets (to split on load)."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    keys = []
    for model, opts in _pairs(model_parts, optimizers):
        msd, osd = get_state_dict(model, opts, options=STATE_OPTIONS)
        model_sd.update(msd)
        optim_sd.update(osd)
        keys.append((set(msd), set(osd)))
    return {"model": model_sd, "optim": optim_sd}, keys


def _signature(sd: Any) -> Any:
    """Structure, shapes and dtypes: when it changes, the staging buffers must be re-allocated."""
    if isinstance(sd, dict):
        return tuple((k, _signature(v)) for k, v in sd.items())
    if isinstance(sd, torch.Tensor):
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        return (tuple(sd.shape), tuple(local.shape), sd.dtype)
    return type(sd).__name__


def _reader_rank(name: str, world_size: int) -> int:
    """The rank that verifies (and loads from its local copy) a checkpoint file on restore."""
    m = _SHARD_RE.match(name)
    return int(m.group(1)) % world_size if m else 0


def memory_available() -> int:
    """Bytes of host memory the kernel can hand out without swapping (MemAvailable); 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _unsafe(err: BaseException) -> UnsafeCheckpoint | None:
    """The UnsafeCheckpoint behind a load failure: DCP wraps each rank's exception in a CheckpointException."""
    if isinstance(err, UnsafeCheckpoint):
        return err
    for failure in (getattr(err, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, UnsafeCheckpoint):
            return inner
    return None


def _first_line(err: BaseException) -> str:
    lines = [ln for ln in str(err).splitlines() if ln.strip() and not ln.startswith((" ", "Traceback"))]
    return (lines[-1] if lines else type(err).__name__)[:300]


# -- preemption ------------------------------------------------------------------------------------------------

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


# -- the checkpointer ------------------------------------------------------------------------------------------


class Checkpointer:
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

    # -- interval ---------------------------------------------------------------------------------------------

    @property
    def interval_steps(self) -> int:
        """The current save interval in steps (the spec's integer, or the Young/Daly choice for "auto")."""
        if self.spec.interval_steps != "auto":
            return int(self.spec.interval_steps)
        if self.last_saved_step is None or self._step_time_s is None or self.last_save_s == 0.0:
            return AUTO_FIRST_STEPS
        cost = self.last_blocking_s + self.last_wait_s
        seconds = young_daly_interval(cost, self.mtbf_s)
        steps = math.ceil(seconds / max(self._step_time_s, 1e-6))
        # never closer than one background save takes, or saves would queue up behind each other
        floor = math.ceil(self.last_save_s / max(self._step_time_s, 1e-6))
        return int(min(AUTO_MAX_STEPS, max(AUTO_MIN_STEPS, floor, steps)))

    @property
    def mtbf_s(self) -> float:
        """Mean time between failures: the prior blended with the observed failures of this run."""
        return (self._run_seconds + self._elapsed() + MTBF_PRIOR_S) / (self._failures + 1)

    def _elapsed(self) -> float:
        return time.monotonic() - self._started

    def should_save(self, step: int) -> bool:
        now = time.monotonic()
        if self._last_step_seen is not None and step > self._last_step_seen[0]:
            dt = (now - self._last_step_seen[1]) / (step - self._last_step_seen[0])
            self._step_time_s = dt if self._step_time_s is None else 0.9 * self._step_time_s + 0.1 * dt
        self._last_step_seen = (step, now)
        if step <= 0:
            return False
        if self.spec.interval_steps == "auto":
            return step - (self.last_saved_step or 0) >= self.interval_steps
        return step % int(self.spec.interval_steps) == 0

    def stop_requested(self, step: int) -> bool:
        """True on every rank at the same step once any rank got SIGTERM (checked every stop_check_every steps)."""
        if not self._distributed:
            return _sigterm.is_set()
        if step % self.stop_check_every:
            return False
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        flag = torch.tensor([1.0 if _sigterm.is_set() else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    # -- save -------------------------------------------------------------------------------------------------

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
        self._wait(before_save=True)
        if step == self.last_saved_step:
            return
        t0 = time.perf_counter()
        state, _ = collect_state(model_parts, optimizers)
        staged = self._stage(state)
        self.last_blocking_s = time.perf_counter() - t0
        self._run_seconds_at_save = self._run_seconds + self._elapsed()
        meta = {
            "step": step,
            "world_size": self.world_size,
            "final": final,
            "time": time.time(),
            "checkpoint": {"run_seconds": self._run_seconds_at_save, "failures": self._failures},
        }
        payload = dict(trainer_state)
        payload["kiln"] = meta
        self.last_saved_step = step
        if final or not self.spec.async_save:
            self._write(step, staged, payload, t0, raise_errors=True)
        else:
            self._future = self._executor.submit(self._write, step, staged, payload, t0, False)
        log.info("checkpoint step %d: staged in %.3fs%s", step, self.last_blocking_s, "" if final else ", uploading")

    def _write(self, step: int, staged: dict, payload: dict, t0: float, raise_errors: bool) -> None:
        """Shards (every rank) → file lists gathered → trainer.json, COMMIT, latest, retention (rank 0).

        Every rank reaches every collective whatever fails where: DCP turns a failed write on any rank into
        an error on all ranks, and rank 0's commit outcome is broadcast, so no rank is left waiting."""
        prefix = step_dir(step)
        keep = self._shm.with_name(self._shm.name + ".next") if self._shm is not None else None
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
        fs = StoreFS(self.store, keep_dir=keep)
        try:
            if self.rank == 0:
                try:
                    self.store.delete(f"{prefix}/COMMIT")  # a stale COMMIT from an older attempt at this step
                except Exception as err:  # noqa: BLE001 - the save goes on; a stale COMMIT fails verification
                    log.warning("checkpoint step %d: could not remove an old COMMIT: %s", step, err)
            writer = StoreWriter(
                fs, prefix, thread_count=self.thread_count, sync_files=self.store.local_path(prefix) is not None
            )
            dcp.save(staged, storage_writer=writer, process_group=self._pg, no_dist=not self._distributed)
            mine = {key.split("/", 1)[1]: entry for key, entry in fs.written.items()}
            everyone = [mine]
            if self._distributed:
                everyone = [None] * self.world_size
                dist.all_gather_object(everyone, mine, group=self._pg)
            failure = None
            if self.rank == 0:
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
            failure = self._bcast(failure)  # every rank learns whether the step is committed
            if failure:
                raise RuntimeError(failure)
            self.last_committed_step = step
            self.last_commit_time = time.time()
            self._keep_in_memory(step, fs, keep)
            self.last_save_s = time.perf_counter() - t0
            if self.rank == 0:
                log.info("checkpoint step %d committed to %s in %.2fs", step, self.store.url(prefix), self.last_save_s)
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            self.save_failures += 1
            msg = (
                f"checkpoint step {step} to {self.store.url(prefix)} failed: {err}; "
                f"the last committed step ({self.last_committed_step}) stays the one to resume from"
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
            manifest = {"step": step, "world_size": self.world_size, "rank": self.rank}
            (keep / SHM_MANIFEST).write_text(json.dumps(manifest) + "\n")
            shutil.rmtree(self._shm, ignore_errors=True)
            os.replace(keep, self._shm)
        except OSError as err:
            log.warning("checkpoint step %d: no host-memory copy in %s (%s); restarts read the store", step, keep, err)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed (or has failed and been logged)."""
        self._wait(before_save=False)

    def _wait(self, before_save: bool) -> None:
        if self._future is None:
            self.last_wait_s = 0.0
            return
        t0 = time.perf_counter()
        done = self._future.done()
        self._future.result()
        self._future = None
        self.last_wait_s = time.perf_counter() - t0 if before_save else 0.0
        if before_save and not done and self.last_wait_s > 0.01:
            log.warning(
                "checkpoint: waited %.2fs for the previous save to finish (the store is slower than the interval)",
                self.last_wait_s,
            )

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
        self._cache = None

    # -- restore ----------------------------------------------------------------------------------------------

    def _bcast(self, obj):
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]

    def restore(self, model_parts, optimizers) -> dict | None:
        """Load the newest committed step whose files all match its COMMIT; older commits are the fallback.
        Returns the trainer_state saved with it (plus a "kiln" entry), or None when there is no commit."""
        self.wait()
        listing = None
        if self.rank == 0:
            try:
                listing = committed_steps(self.store)
            except (KilnError, OSError) as err:  # every rank raises it, none waits for rank 0
                listing = f"cannot list checkpoints at {self.store.uri}: {err}"
        candidates = self._bcast(listing)
        if isinstance(candidates, str):
            raise KilnError(candidates)
        if self.rank == 0:
            latest = read_latest(self.store)
            if candidates and latest is not None and latest != candidates[0]:
                log.warning(
                    "checkpoint: 'latest' says step %s, but step %s is committed; using the commit",
                    latest,
                    candidates[0],
                )
        for step in candidates:
            if step == candidates[0]:
                trainer_state = self._restore_from_memory(step, model_parts, optimizers)
                if trainer_state is not None:
                    return trainer_state
            t0 = time.perf_counter()
            problems, fetched = self._fetch_verified(step)
            if problems:
                if self.rank == 0:
                    log.warning(
                        "checkpoint step %d at %s is damaged (%s); falling back to the previous commit",
                        step,
                        self.store.url(step_dir(step)),
                        "; ".join(problems),
                    )
                continue
            try:
                self._load(step, model_parts, optimizers, StoreFS(self.store, fetched=fetched))
            except (Exception, CheckpointException) as err:  # DCP raises the same on every rank
                self._refuse_if_unsafe(step, err)
                raise KilnError(
                    f"checkpoint step {step} at {self.store.url(step_dir(step))} does not fit this model "
                    f"({_first_line(err)}); was it saved by a different model? Use a new checkpoint.uri to start over"
                ) from None
            return self._restored(step, read_trainer_state(self.store, step), self.store.url(step_dir(step)), t0)
        return None

    def _load(self, step: int, model_parts, optimizers, fs: StoreFS) -> None:
        state, keys = collect_state(model_parts, optimizers)
        reader = StoreReader(fs, step_dir(step))  # and its planner: nothing in the files runs as code
        try:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(reader), process_group=self._pg,
                     no_dist=not self._distributed)
        except (Exception, CheckpointException):
            if reader.refused is not None:  # what this rank refused, in its own words (DCP may fold it into text)
                raise reader.refused from None
            raise
        for (model, opts), (mkeys, okeys) in zip(_pairs(model_parts, optimizers), keys):
            set_state_dict(
                model,
                opts,
                model_state_dict={k: state["model"][k] for k in mkeys},
                optim_state_dict={k: state["optim"][k] for k in okeys},
                options=STATE_OPTIONS,
            )

    def _restored(self, step: int, trainer_state: dict, source: str, t0: float) -> dict:
        meta = trainer_state.get("kiln", {})
        book = meta.get("checkpoint", {})
        self._run_seconds = float(book.get("run_seconds", 0.0))
        # a restart from a non-final checkpoint means the previous process died: count it for the MTBF
        self._failures = int(book.get("failures", 0)) + (0 if meta.get("final") else 1)
        self.last_saved_step = self.last_committed_step = step
        self.last_restore_source = "memory" if source == "memory" else self.store.url("")
        if self.rank == 0:
            log.info("checkpoint: restored step %d from %s in %.2fs", step, source, time.perf_counter() - t0)
        return trainer_state

    def _restore_from_memory(self, step: int, model_parts, optimizers) -> dict | None:
        """Load the newest commit from the ranks' host-memory copies when every rank has a whole one for this
        step and world size (all ranks agree, so all take the same path); else None and the store is used.
        Only the small files (COMMIT, .metadata, trainer.json) and shards no rank on this node holds are read
        from the store, each checked against COMMIT first."""
        if self._shm is None and not self._distributed:
            return None
        t0 = time.perf_counter()
        commit = self._bcast(self._read_commit_or_none(step) if self.rank == 0 else None)
        if isinstance(commit, str):
            return None  # the store path reports it
        mine = read_shm_copy(self._shm, step, self.world_size, commit) if self._shm is not None else "off"
        reasons = [mine if isinstance(mine, str) else None]
        if self._distributed:
            reasons = [None] * self.world_size
            dist.all_gather_object(reasons, mine if isinstance(mine, str) else None, group=self._pg)
        if any(reasons):
            why = [f"rank {r}: {w}" for r, w in enumerate(reasons) if w and w != "off"]
            if self.rank == 0 and why:
                log.warning("checkpoint step %d: not restoring from host memory (%s); reading the store", step, "; ".join(why))
            return None
        local = dict(mine)
        for other in sorted(self._shm.parent.glob("rank-*")):  # the other ranks on this node checked theirs
            copy = read_shm_copy(other, step, self.world_size, commit, hash=False) if other != self._shm else {}
            if not isinstance(copy, str):
                local = {**copy, **local}
        checked: set[str] = set()

        def check_remote(name: str) -> None:
            if name not in checked:
                problems = verify_files(self.store, step, commit, [name])
                if problems:
                    raise KilnError(f"{self.store.url(step_dir(step))}: " + "; ".join(problems))
                checked.add(name)

        try:
            fs = StoreFS(self.store, local_files=local, check_remote=check_remote)
            self._load(step, model_parts, optimizers, fs)
            check_remote("trainer.json")
            trainer_state = read_trainer_state(self.store, step)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP fails on every rank alike
            self._refuse_if_unsafe(step, err)
            if self.rank == 0:
                log.warning("checkpoint step %d: host-memory restore failed (%s); reading the store", step, _first_line(err))
            return None
        return self._restored(step, trainer_state, "memory", t0)

    def _refuse_if_unsafe(self, step: int, err: BaseException) -> None:
        """A file that would run code stops the restore, on every rank: no fallback to an older commit, which
        the same writer may have prepared too."""
        unsafe = _unsafe(err)
        if unsafe is not None:
            raise KilnError(f"checkpoint step {step} at {self.store.url(step_dir(step))}: {unsafe}") from None

    def _fetch_verified(self, step: int) -> tuple[list[str], dict[str, list[bytes]]]:
        """Every rank checks its share of the files (size + sha256) against COMMIT, reading each once and, from
        a remote store, keeping the checked bytes for DCP to load: a rank's share is the shards it wrote
        (`__<rank>_<n>.distcp`, what it loads again at the same world size), the rest goes to rank 0.
        Returns the problems of all ranks (gathered, so all ranks agree) and this rank's verified bytes."""
        commit = self._bcast(self._read_commit_or_none(step) if self.rank == 0 else None)
        if isinstance(commit, str):
            return [commit], {}
        names = [n for n in sorted(commit.files) if _reader_rank(n, self.world_size) == self.rank]
        share = sum(commit.files[n].size for n in names)
        # The checked bytes wait in host memory until DCP has loaded them; a share too big for that is checked
        # here and read from the store a second time by the loader instead.
        keep = share <= memory_available() // 2
        if not keep:
            log.warning(
                "checkpoint step %d: rank %d's %d MiB do not fit in half the available host memory; checking "
                "them, then downloading them again to load",
                step,
                self.rank,
                share >> 20,
            )
        mine, fetched = fetch_verified(self.store, step, commit, names, keep=keep)
        if not self._distributed:
            return mine, fetched
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self._pg)
        return [p for part in everyone for p in part], fetched

    def _read_commit_or_none(self, step: int):
        try:
            return read_commit(self.store, step)
        except (KilnError, OSError) as err:
            return f"COMMIT unreadable: {err}"

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
