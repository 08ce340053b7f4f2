"""Each rank's copy of the newest committed checkpoint in host memory, for fast restarts on the same node
(docs/checkpoints.md, "Fast restart from host memory"). The Checkpointer writes the copy after a commit and
reads it on restore when every rank's copy is whole; these helpers name and check it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kiln.api import contract
from kiln.storage.commit import Commit, sha256_file

SHM_MANIFEST = "SHM.json"


def shm_dir(uri: str, rank: int) -> Path | None:
    """This rank's copy of the newest commit in host memory: <KILN_SHM_DIR>/<run>/rank-<r>, e.g. KILN_SHM_DIR=
    /dev/shm/kiln; None (off) when unset. Opt-in: a pod's /dev/shm is 64 MiB unless a memory-backed volume is
    mounted there. <run> hashes the checkpoint URI, so runs sharing a node never mix their copies."""
    root = os.environ.get(contract.SHM_DIR, "")
    if root.strip().lower() in ("", "off", "0", "none", "false"):
        return None
    return Path(root) / hashlib.sha256(uri.encode()).hexdigest()[:16] / f"rank-{rank}"


def read_shm_copy(path: Path, step: int, world_size: int, commit: Commit, *, hash: bool = True) -> dict[str, Path] | str:
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
