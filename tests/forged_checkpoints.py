"""Checkpoints as a hostile bucket writer would forge them (issue 13, item 1; issue 28): files whose unpickling
would run a command, with a COMMIT that matches them. Used by the untrusted-checkpoint and last-line tests."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path

import torch

from kiln.storage import FileStore
from kiln.storage.commit import COMMIT, Commit, FileEntry, read_commit, step_dir
from kiln.trainer.checkpoint.dcp_store import load_metadata


class RunsCommand:
    """Unpickling this runs `touch <marker>`: what a hostile bucket writer would put in a checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def forge(root: Path, step: int, files: dict[str, bytes]) -> None:
    """Write `files` into the step's folder and a COMMIT that matches them, as a bucket writer could."""
    store = FileStore(str(root))
    commit = read_commit(store, step)
    for name, data in files.items():
        (root / step_dir(step) / name).write_bytes(data)
        commit.files[name] = FileEntry(len(data), hashlib.sha256(data).hexdigest())
    (root / step_dir(step) / COMMIT).write_bytes(Commit(step, commit.files).to_bytes())


def redirect_item(root: Path, step: int, fqn: str, blob: bytes, in_file: str = "") -> str:
    """Append `blob` to the shard holding item `fqn` (its chunk in a file whose name starts with `in_file`)
    and point the metadata at it, offsets and COMMIT kept consistent: the shard then holds a valid-looking
    item whose pickle runs a command. Returns the shard's name."""
    folder = root / step_dir(step)
    with open(folder / ".metadata", "rb") as f:
        metadata = load_metadata(f, ".metadata")
    index = next(i for i, info in metadata.storage_data.items()
                 if i.fqn == fqn and info.relative_path.startswith(in_file))
    info = metadata.storage_data[index]
    shard = (folder / info.relative_path).read_bytes()
    info.offset, info.length = len(shard), len(blob)
    forge(root, step, {info.relative_path: shard + blob, ".metadata": pickle.dumps(metadata)})
    return info.relative_path


def torch_blob(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def metadata_with(root: Path, step: int, payload) -> bytes:
    """The step's real metadata with `payload` hidden in planner_data."""
    with open(root / step_dir(step) / ".metadata", "rb") as f:
        metadata = load_metadata(f, ".metadata")
    metadata.planner_data = {"x": payload}
    return pickle.dumps(metadata)
