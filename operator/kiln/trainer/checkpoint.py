"""Asynchronous, atomic checkpoints that any world size can resume (DESIGN.md §4, docs/checkpoints.md).

Model and optimizer state go through `torch.distributed.checkpoint` (DCP) as sharded, FQN-keyed state dicts
from `get_state_dict`, so a checkpoint saved with one parallel layout loads into any other (DCP reshards).
DCP's FileSystemWriter/Reader do the (de)serialisation; their file system is swapped for one over a kiln
ObjectStore (`StoreFS`): each shard file is written to a local staging file (hashed as it is written) and, once
complete, uploaded as a parallel multipart PUT by the same writer thread — so serialising one shard overlaps
uploading another, memory stays bounded by the staged state, and a transient S3 failure re-reads the local file
instead of re-serialising. On file:// the shard is written in place. Reads use ranged GETs with parallel
read-ahead; restore first checks every file's size and sha256 against COMMIT, the files split over the ranks.

A save blocks the training loop only to copy the state off the accelerator (into reused pinned host buffers on
GPU, a CPU copy on CPU); the upload, the COMMIT (rank 0, after every rank's file list with sizes and sha256s
is gathered) and retention run in one background thread on a separate gloo process group. At most one save
is in flight; the next one waits for it and says how long it waited.

Preemption: call `install_sigterm_handler()` once, and in the loop `if ckpt.stop_requested(step):
ckpt.save(step, ..., final=True); break` — every rank agrees on the same step before saving.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, _FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

from kiln.api.spec import CheckpointSpec
from kiln.errors import KilnError
from kiln.storage import ObjectStore, open_store
from kiln.storage.commit import (
    FileEntry,
    apply_retention,
    committed_steps,
    read_commit,
    read_latest,
    read_trainer_state,
    sha256_file,
    step_dir,
    verify_files,
    write_commit,
    young_daly_interval,
)

log = logging.getLogger("kiln.checkpoint")

STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # FQN keys: mergeable over pipeline stages

# intervalSteps: auto — bounds and priors (Young/Daly needs a cost and an MTBF before it has measured either).
AUTO_MIN_STEPS = 10
AUTO_MAX_STEPS = 10_000
AUTO_FIRST_STEPS = 10  # first save early, to measure its cost
MTBF_PRIOR_S = float(os.environ.get("KILN_MTBF_PRIOR_SECONDS", 6 * 3600))  # one failure per this, before evidence


# -- DCP over an ObjectStore ------------------------------------------------------------------------------------


class StoreFS(FileSystemBase):
    """DCP's file-system interface over an ObjectStore. Paths are '/'-joined keys relative to the store root.

    A written file is published (hashed; uploaded unless the store is local) when its stream closes; a `*.tmp`
    file is published under its new name by `rename` (DCP writes `.metadata.tmp` then renames it).
    """

    def __init__(
        self,
        store: ObjectStore,
        staging_dir: Path,
        read_block: int = 8 << 20,
        *,
        keep_dir: Path | None = None,
        local_files: dict[str, Path] | None = None,
        check_remote=None,
    ):
        self.store = store
        self.staging_dir = staging_dir
        self.read_block = read_block
        self.keep_dir = keep_dir  # staged shards are moved here after upload (the host-memory copy)
        self.local_files = local_files or {}  # file name → verified host-memory copy, read instead of the store
        self.check_remote = check_remote  # called with a file name before it is first read from the store
        self.written: dict[str, FileEntry] = {}  # key → entry, for the COMMIT
        self._pending: dict[str, tuple[Path, FileEntry]] = {}  # *.tmp key → local file
        self.errors: list[tuple[str, BaseException]] = []  # files that failed, in any writer thread
        self._lock = threading.Lock()

    def _local_for_write(self, key: str) -> tuple[Path, bool]:
        local = self.store.local_path(key)
        if local is not None:
            local.parent.mkdir(parents=True, exist_ok=True)
            return local, False
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.staging_dir, prefix=key.replace("/", "_") + ".")
        os.close(fd)
        return Path(name), True

    def _publish(self, key: str, path: Path, staged: bool, entry: FileEntry) -> None:
        if staged:
            try:
                self.store.put_file(key, path)
                if self.keep_dir is not None:
                    self.keep_dir.mkdir(parents=True, exist_ok=True)
                    shutil.move(path, self.keep_dir / key.rsplit("/", 1)[-1])
            finally:
                path.unlink(missing_ok=True)
        with self._lock:
            self.written[key] = entry

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Generator[io.IOBase, None, None]:
        key = str(path)
        if "r" in mode:
            local = self.local_files.get(key.rsplit("/", 1)[-1])
            if local is None and self.check_remote is not None:
                self.check_remote(key.rsplit("/", 1)[-1])
            local = local or self.store.local_path(key)
            if local is not None:
                with open(local, "rb") as f:
                    yield f
            else:
                reader = RangedReader(self.store, key, self.read_block)
                try:
                    yield reader
                finally:
                    reader.close()
            return
        try:
            local, staged = self._local_for_write(key)
            with open(local, "wb") as f:
                stream = HashingWriter(f)
                yield stream
            entry = FileEntry(stream.size, stream.sha.hexdigest())
            if key.endswith(".tmp"):
                with self._lock:
                    self._pending[key] = (local, entry)
                return
            self._publish(key, local, staged, entry)
        except BaseException as err:
            # DCP's extra writer threads drop exceptions; StoreWriter re-raises what is recorded here
            with self._lock:
                self.errors.append((key, err))
            raise

    def rename(self, path, new_path) -> None:
        src, dst = str(path), str(new_path)
        with self._lock:
            local, entry = self._pending.pop(src)
        target = self.store.local_path(dst)
        if target is not None:
            os.replace(local, target)
            self._publish(dst, target, False, entry)
        else:
            self._publish(dst, local, True, entry)

    def concat_path(self, path, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path) -> str:
        return str(path)

    def mkdir(self, path) -> None:
        local = self.store.local_path(str(path))
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def exists(self, path) -> bool:
        return self.store.exists(str(path))

    def rm_file(self, path) -> None:
        self.store.delete(str(path))


class HashingWriter(io.RawIOBase):
    """Passes writes through to a file while computing their sha256, so a shard is never read back to hash it
    (DCP writes each file sequentially: torch.save streams its zip, offsets come from tell())."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self.f.write(b)
        self.sha.update(b)
        self.size += len(memoryview(b).cast("B"))
        return n

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:  # the file is closed by its owner
        pass


class RangedReader(io.RawIOBase):
    """A seekable read-only stream over one stored object, made of block-aligned ranged GETs.

    torch.load reads in many small pieces, mostly forwards: each block is fetched once, and the next
    `ahead` blocks are fetched in parallel in the background, so a sequential scan runs at parallel-GET speed.
    """

    def __init__(
        self, store: ObjectStore, key: str, block: int, ahead: int = 8, pool: ThreadPoolExecutor | None = None
    ):
        self.store, self.key, self.block, self.ahead = store, key, block, ahead
        self.length = store.size(key)
        self.nblocks = (self.length + block - 1) // block
        self.pos = 0
        self.blocks: OrderedDict[int, Future] = OrderedDict()
        self.pool = pool or ThreadPoolExecutor(ahead, thread_name_prefix="kiln-ckpt-read")
        self._own_pool = pool is None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _block(self, b: int) -> bytes:
        for nb in range(b, min(b + 1 + self.ahead, self.nblocks)):
            if nb not in self.blocks:
                off = nb * self.block
                self.blocks[nb] = self.pool.submit(
                    self.store.get_bytes, self.key, off, min(self.block, self.length - off)
                )
        self.blocks.move_to_end(b)
        data = self.blocks[b].result()
        while len(self.blocks) > 2 * (self.ahead + 1):  # drop the oldest blocks (reads move forwards)
            self.blocks.popitem(last=False)
        return data

    def readinto(self, buf) -> int:
        n = min(len(buf), self.length - self.pos)
        if n <= 0:
            return 0
        view = memoryview(buf).cast("B")
        done = 0
        while done < n:
            b, start = divmod(self.pos + done, self.block)
            data = self._block(b)
            take = min(len(data) - start, n - done)
            view[done : done + take] = data[start : start + take]
            done += take
        self.pos += n
        return n

    def close(self) -> None:
        if self._own_pool:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.blocks.clear()
        super().close()


class StoreWriter(_FileSystemWriter):
    """DCP's FileSystemWriter with its file system swapped for StoreFS."""

    def __init__(self, fs: StoreFS, step_prefix: str, *, thread_count: int, sync_files: bool):
        super().__init__(step_prefix, single_file_per_rank=True, sync_files=sync_files, thread_count=thread_count)
        self.fs = fs
        self.path = step_prefix

    def write_data(self, plan, planner):
        result = super().write_data(plan, planner)
        if self.fs.errors:  # a shard failed in a writer thread: fail the save on every rank (DCP gathers this)
            key, err = self.fs.errors[0]
            raise OSError(f"writing {self.fs.store.url(key)} failed: {type(err).__name__}: {err}") from err
        return result


class StoreReader(FileSystemReader):
    """DCP's FileSystemReader with its file system swapped for StoreFS."""

    def __init__(self, fs: StoreFS, step_prefix: str):
        super().__init__(step_prefix)
        self.fs = fs
        self.path = step_prefix


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


def _first_line(err: BaseException) -> str:
    lines = [ln for ln in str(err).splitlines() if ln.strip() and not ln.startswith((" ", "Traceback"))]
    return (lines[-1] if lines else type(err).__name__)[:300]


# -- preemption ------------------------------------------------------------------------------------------------

_sigterm = threading.Event()


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


# -- host-memory copy for fast restarts --------------------------------------------------------------------------

SHM_MANIFEST = "SHM.json"


def shm_dir(uri: str, rank: int) -> Path | None:
    """This rank's copy of the newest commit in host memory: <KILN_SHM_DIR>/<run>/rank-<r>, e.g. KILN_SHM_DIR=
    /dev/shm/kiln; None (off) when unset. Opt-in: a pod's /dev/shm is 64 MiB unless a memory-backed volume is
    mounted there. <run> hashes the checkpoint URI, so runs sharing a node never mix their copies."""
    root = os.environ.get("KILN_SHM_DIR", "")
    if root.strip().lower() in ("", "off", "0", "none", "false"):
        return None
    return Path(root) / hashlib.sha256(uri.encode()).hexdigest()[:16] / f"rank-{rank}"


def read_shm_copy(path: Path, step: int, world_size: int, commit, *, hash: bool = True) -> dict[str, Path] | str:
    """The files of a rank's host-memory copy of `step` (name → path), each checked (size; sha256 unless
    `hash` is off: the owning rank hashes its own) against the store's COMMIT; or why the copy cannot be used."""
    try:
        manifest = json.loads((path / SHM_MANIFEST).read_text())
    except FileNotFoundError:
        return f"no copy in {path}"
    except (OSError, ValueError) as err:
        return f"{path / SHM_MANIFEST} unreadable ({err})"
    if manifest.get("step") != step:
        return f"{path} holds step {manifest.get('step')}, the newest commit is {step}"
    if manifest.get("world_size") != world_size:
        return f"{path} was saved by {manifest.get('world_size')} ranks, this job has {world_size}"
    files: dict[str, Path] = {}
    for f in sorted(path.iterdir()):
        if f.name == SHM_MANIFEST:
            continue
        entry = commit.files.get(f.name)
        if entry is None:
            return f"{f} is not in the COMMIT of step {step}"
        size = f.stat().st_size
        if size != entry.size:
            return f"{f} has {size} bytes, COMMIT says {entry.size}"
        if hash and sha256_file(f) != entry.sha256:
            return f"{f} sha256 does not match COMMIT"
        files[f.name] = f
    return files or f"{path} holds no files"


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
        staging_dir: str | None = None,
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
        # S3 shards are staged here before upload (KILN_CKPT_STAGING_DIR: a fast local disk, or /dev/shm)
        staging = staging_dir or os.environ.get("KILN_CKPT_STAGING_DIR") or tempfile.gettempdir()
        self._staging_root = Path(staging) / f"kiln-ckpt-stage-{os.getpid()}"
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
        fs = StoreFS(self.store, self._staging_root / prefix, keep_dir=keep)
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
            shutil.rmtree(self._staging_root / prefix, ignore_errors=True)
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
        shutil.rmtree(self._staging_root, ignore_errors=True)

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
            problems = self._verify(step)
            if problems:
                if self.rank == 0:
                    log.warning(
                        "checkpoint step %d at %s is damaged (%s); falling back to the previous commit",
                        step,
                        self.store.url(step_dir(step)),
                        "; ".join(problems),
                    )
                continue
            t0 = time.perf_counter()
            try:
                self._load(step, model_parts, optimizers, StoreFS(self.store, self._staging_root / "restore"))
            except (Exception, CheckpointException) as err:  # DCP raises the same on every rank
                raise KilnError(
                    f"checkpoint step {step} at {self.store.url(step_dir(step))} does not fit this model "
                    f"({_first_line(err)}); was it saved by a different model? Use a new checkpoint.uri to start over"
                ) from None
            return self._restored(step, read_trainer_state(self.store, step), self.store.url(step_dir(step)), t0)
        return None

    def _load(self, step: int, model_parts, optimizers, fs: StoreFS) -> None:
        state, keys = collect_state(model_parts, optimizers)
        dcp.load(
            state, storage_reader=StoreReader(fs, step_dir(step)), process_group=self._pg, no_dist=not self._distributed
        )
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
            fs = StoreFS(self.store, self._staging_root / "restore", local_files=local, check_remote=check_remote)
            self._load(step, model_parts, optimizers, fs)
            check_remote("trainer.json")
            trainer_state = read_trainer_state(self.store, step)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP fails on every rank alike
            if self.rank == 0:
                log.warning("checkpoint step %d: host-memory restore failed (%s); reading the store", step, _first_line(err))
            return None
        return self._restored(step, trainer_state, "memory", t0)

    def _verify(self, step: int) -> list[str]:
        """Every rank checks its share of the files (size + sha256); the problems are gathered everywhere."""
        commit = self._bcast(self._read_commit_or_none(step) if self.rank == 0 else None)
        if isinstance(commit, str):
            return [commit]
        names = sorted(commit.files)[self.rank :: self.world_size] if self._distributed else sorted(commit.files)
        mine = verify_files(self.store, step, commit, names)
        if not self._distributed:
            return mine
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self._pg)
        return [p for part in everyone for p in part]

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
