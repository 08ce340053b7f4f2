"""Restoring a checkpoint: the newest commit whose files match it, from host memory or the store; a file
that would run code stops the restore (kiln.trainer.checkpoint.checkpointer)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from kiln.errors import KilnError
from kiln.text import duration
from kiln.storage import ObjectStore
from kiln.storage.commit import (
    committed_steps,
    fetch_verified,
    read_commit,
    read_latest,
    read_trainer_state,
    step_dir,
    verify_files,
)
from kiln.trainer.checkpoint.dcp_store import SafeLoadPlanner, StoreFS, StoreReader, UnsafeCheckpoint
from kiln.trainer.checkpoint.host_copy import read_shm_copy
from kiln.trainer.checkpoint.stats import CheckpointStats, Ranks
from kiln.trainer.state import ModelState

log = logging.getLogger("kiln.checkpoint")

_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's shard names: __<rank>_<n>.distcp


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


class CheckpointRestore:
    """The Checkpointer's restores: the newest verified commit, from host memory or the store. A restore sets
    `stats` to the commit it loaded (`CheckpointStats.restored`)."""

    def __init__(self, store: ObjectStore, ranks: Ranks, stats: CheckpointStats, *, shm: Path | None):
        self.store, self.ranks, self.stats, self.shm = store, ranks, stats, shm
        self.last_restore_source: str | None = None  # "memory" or the store's URI, after restore()
        self.resumed_from: tuple[int, float, bool] | None = None  # (step, commit time, from host memory)

    def restore(self, model_parts, optimizers, check=None) -> dict | None:
        """Load the newest committed step whose files all match its COMMIT; older commits are the fallback.
        Returns the trainer_state saved with it (plus a "kiln" entry), or None when there is no commit. When every
        commit is damaged, a KilnError naming the newest one's damage: starting over would let the first save's
        retention delete them, and they may be repaired (a copy that is still uploading, a restored backup).
        check(trainer_state, where) may refuse a commit before any tensor is loaded: it returns why (a KilnError
        then), else None. The caller waits for its save in flight first."""
        ranks = self.ranks
        listing = None
        if ranks.rank == 0:
            try:
                listing = committed_steps(self.store)
            except (KilnError, OSError) as err:  # every rank raises it, none waits for rank 0
                listing = f"cannot list checkpoints at {self.store.uri}: {err}"
        candidates = ranks.bcast(listing)
        if isinstance(candidates, str):
            raise KilnError(candidates)
        if ranks.rank == 0:
            latest = read_latest(self.store)
            if candidates and latest is not None and latest != candidates[0]:
                log.warning(
                    "checkpoint: 'latest' says step %s, but step %s is committed; using the commit",
                    latest,
                    candidates[0],
                )
        damage: dict[int, list[str]] = {}
        for step in candidates:
            if step == candidates[0]:
                trainer_state = self._restore_from_memory(step, model_parts, optimizers, check)
                if trainer_state is not None:
                    return trainer_state
            t0 = time.perf_counter()
            problems, fetched, committed_at = self._fetch_verified(step)
            if not problems:  # a trainer.json that matches COMMIT but does not parse is damage too
                try:
                    trainer_state = read_trainer_state(self.store, step)
                except (KilnError, OSError) as err:
                    problems = [str(err)]
            if problems:
                damage.setdefault(step, problems)
                if ranks.rank == 0:
                    log.warning(
                        "checkpoint step %d at %s is damaged (%s); falling back to the previous commit",
                        step,
                        self.store.url(step_dir(step)),
                        "; ".join(problems),
                    )
                continue
            if check is not None and (refused := check(trainer_state, self.store.url(step_dir(step)))):
                raise KilnError(refused)
            try:
                self._load(step, model_parts, optimizers, StoreFS(self.store, fetched=fetched))
            except (Exception, CheckpointException) as err:  # DCP raises the same on every rank
                self._refuse_if_unsafe(step, err)
                raise KilnError(
                    f"checkpoint step {step} at {self.store.url(step_dir(step))} does not fit this model "
                    f"({_first_line(err)}); was it saved by a different model? Use a new checkpoint.uri to start over"
                ) from None
            return self._restored(step, trainer_state, self.store.url(step_dir(step)), t0, committed_at)
        if damage:
            newest = max(damage)
            raise KilnError(
                f"every committed checkpoint under {self.store.uri} is damaged ({len(damage)} step(s); the newest, "
                f"{self.store.url(step_dir(newest))}: {'; '.join(damage[newest][:3])}); restore the files, or use "
                f"a new checkpoint.uri to start over")
        return None

    def _load(self, step: int, model_parts, optimizers, fs: StoreFS) -> None:
        model = ModelState(model_parts, optimizers)
        state = model.state_dict()  # DCP loads into its tensors, in place
        reader = StoreReader(fs, step_dir(step))  # and its planner: nothing in the files runs as code
        try:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(reader), process_group=self.ranks.pg,
                     no_dist=not self.ranks.distributed)
        except (Exception, CheckpointException):
            if reader.refused is not None:  # what this rank refused, in its own words (DCP may fold it into text)
                raise reader.refused from None
            raise
        model.load_state_dict(state)

    def _restored(self, step: int, trainer_state: dict, source: str, t0: float, committed_at: float) -> dict:
        self.stats.restored(step, trainer_state.get("kiln", {}))
        self.last_restore_source = "memory" if source == "memory" else self.store.url("")
        self.resumed_from = (step, committed_at, source == "memory")
        if self.ranks.rank == 0:
            log.info("checkpoint: restored step %d from %s in %.2fs", step, source, time.perf_counter() - t0)
        return trainer_state

    def resume_line(self, now: float | None = None) -> str:
        """What a resumed run says first (issue 28): which commit it resumed from, its step, URI and age."""
        step, committed_at, memory = self.resumed_from
        where = self.store.url(step_dir(step))
        return (f"kiln: resumed from step {step} at {where} (committed {duration((now or time.time()) - committed_at)} "
                f"ago{'; read from the host-memory copy' if memory else ''})")

    def _restore_from_memory(self, step: int, model_parts, optimizers, check=None) -> dict | None:
        """Load the newest commit from the ranks' host-memory copies when every rank has a whole one for this
        step and world size (all ranks agree, so all take the same path); else None and the store is used.
        Only the small files (COMMIT, .metadata, trainer.json) and shards no rank on this node holds are read
        from the store, each checked against COMMIT first."""
        ranks = self.ranks
        if self.shm is None and not ranks.distributed:
            return None
        t0 = time.perf_counter()
        commit = ranks.bcast(self._read_commit_or_none(step) if ranks.rank == 0 else None)
        if isinstance(commit, str):
            return None  # the store path reports it
        mine = read_shm_copy(self.shm, step, ranks.world_size, commit) if self.shm is not None else "off"
        reasons = ranks.gather(mine if isinstance(mine, str) else None)
        if any(reasons):
            why = [f"rank {r}: {w}" for r, w in enumerate(reasons) if w and w != "off"]
            if ranks.rank == 0 and why:
                log.warning("checkpoint step %d: not restoring from host memory (%s); reading the store", step, "; ".join(why))
            return None
        local = dict(mine)
        for other in sorted(self.shm.parent.glob("rank-*")):  # the other ranks on this node checked theirs
            copy = read_shm_copy(other, step, ranks.world_size, commit, hash=False) if other != self.shm else {}
            if not isinstance(copy, str):
                local = {**copy, **local}
        checked: set[str] = set()

        def check_remote(name: str) -> None:
            if name not in checked:
                problems = verify_files(self.store, step, commit, [name])
                if problems:
                    raise KilnError(f"{self.store.url(step_dir(step))}: " + "; ".join(problems))
                checked.add(name)

        refused = None
        try:
            check_remote("trainer.json")
            trainer_state = read_trainer_state(self.store, step)
            refused = check(trainer_state, self.store.url(step_dir(step))) if check is not None else None
            if refused is None:
                fs = StoreFS(self.store, local_files=local, check_remote=check_remote)
                self._load(step, model_parts, optimizers, fs)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP fails on every rank alike
            self._refuse_if_unsafe(step, err)
            if ranks.rank == 0:
                log.warning("checkpoint step %d: host-memory restore failed (%s); reading the store", step, _first_line(err))
            return None
        if refused:
            raise KilnError(refused)
        return self._restored(step, trainer_state, "memory", t0, commit.time)

    def _refuse_if_unsafe(self, step: int, err: BaseException) -> None:
        """A file that would run code stops the restore, on every rank: no fallback to an older commit, which
        the same writer may have prepared too."""
        unsafe = _unsafe(err)
        if unsafe is not None:
            raise KilnError(f"checkpoint step {step} at {self.store.url(step_dir(step))}: {unsafe}") from None

    def _fetch_verified(self, step: int) -> tuple[list[str], dict[str, list[bytes]], float]:
        """Every rank checks its share of the files (size + sha256) against COMMIT, reading each once and, from
        a remote store, keeping the checked bytes for DCP to load: a rank's share is the shards it wrote
        (`__<rank>_<n>.distcp`, what it loads again at the same world size), the rest goes to rank 0.
        Returns the problems of all ranks (gathered, so all ranks agree), this rank's verified bytes and the
        time the commit was written."""
        ranks = self.ranks
        commit = ranks.bcast(self._read_commit_or_none(step) if ranks.rank == 0 else None)
        if isinstance(commit, str):
            return [commit], {}, 0.0
        names = [n for n in sorted(commit.files) if _reader_rank(n, ranks.world_size) == ranks.rank]
        share = sum(commit.files[n].size for n in names)
        # The checked bytes wait in host memory until DCP has loaded them; a share too big for that is checked
        # here and read from the store a second time by the loader instead.
        keep = share <= memory_available() // 2
        if not keep:
            log.warning(
                "checkpoint step %d: rank %d's %d MiB do not fit in half the available host memory; checking "
                "them, then downloading them again to load",
                step,
                ranks.rank,
                share >> 20,
            )
        mine, fetched = fetch_verified(self.store, step, commit, names, keep=keep)
        return [p for part in ranks.gather(mine) for p in part], fetched, commit.time

    def _read_commit_or_none(self, step: int):
        try:
            return read_commit(self.store, step)
        except (KilnError, OSError) as err:
            return f"COMMIT unreadable: {err}"
