"""The trainer run as a user runs it: write a spec of the micro model (write_spec), run `kiln` (kiln, env), read
its metrics.jsonl (read_metrics), and the held-out tokens of builtin:pydoc (validation_tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from kiln.trainer.data.loader import VALIDATION_FRACTION, pydoc_bytes
from tests.support.ranks import SAFETY_TIMEOUT_S
from tests.support.specs import MICRO_MODEL, MICRO_MOE_MODEL  # noqa: F401 (the tests that write specs take it from here too)


def write_spec(path: Path, *, training: dict | None = None, parallelism: dict | None = None,
               model: dict | None = None, checkpoint: dict | None = None, data: str = "builtin:pydoc",
               nproc: int = 1, resources: dict | None = None, elastic: dict | None = None,
               **spec: dict) -> Path:
    """A TrainingSpec file of the micro model; `spec` adds top-level spec sections (e.g. tracking=...)."""
    doc = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "t"},
        "spec": {
            "model": model or MICRO_MODEL,
            "data": {"uri": data},
            "training": {"steps": 4, "globalBatchSize": 4, "microBatchSize": 1, "lr": 1e-3, "warmupSteps": 0,
                         "precision": "fp32", "seed": 3, **(training or {})},
            "parallelism": {"compile": False, **(parallelism or {})},
            "checkpoint": {"intervalSteps": 1000, **(checkpoint or {})},
            "resources": resources or {"processesPerNode": nproc},
            **({"elastic": elastic} if elastic else {}),
            **spec,
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def env(**extra: str) -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", **extra)
    return e


def train_micro_moe(spec_dir: Path, out: Path, *, steps: int, nproc: int, parallelism: dict) -> list[dict]:
    """The micro MoE (4 global sequences a step, constant learning rate, a commit every step) trained by
    `kiln train` on nproc processes in `parallelism`; its step records (those with a loss)."""
    spec = write_spec(spec_dir / f"spec-{steps}-{nproc}.yaml", parallelism=parallelism,
                      training={"schedule": "constant", "globalBatchSize": 4, "steps": steps},
                      model=MICRO_MOE_MODEL, checkpoint={"intervalSteps": 1}, nproc=nproc)
    return [r for r in torchrun_train(spec, out, nproc) if "loss" in r]


def torchrun_train(spec: Path, out: Path, nproc: int, timeout: float = SAFETY_TIMEOUT_S,
                   observe: Path | None = None, extra_env: dict | None = None) -> list[dict]:
    """`kiln train` on nproc real processes (torchrun, gloo); the records of metrics.jsonl. `observe`: run it
    under tests.distributed.observed_train, which writes what each rank computed in to observe/rank-<r>.json."""
    proc = torchrun_kiln(spec, out, nproc, timeout, observe, extra_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return read_metrics(out)


def torchrun_kiln(spec: Path, out: Path, nproc: int, timeout: float = SAFETY_TIMEOUT_S,
                  observe: Path | None = None, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """`kiln train` on nproc real processes (torchrun, gloo), however it ends."""
    entry = "tests.distributed.observed_train" if observe else "kiln.cli.main"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", entry, "train", "--config", str(spec), "--output", str(out)]
    extra = {**({"KILN_OBSERVE_DIR": str(observe)} if observe else {}), **(extra_env or {})}
    return subprocess.run(cmd, env=env(**extra), capture_output=True, text=True, timeout=timeout, check=False)


def observed(observe: Path, nproc: int) -> list[dict]:
    """What each rank recorded under tests.distributed.observed_train."""
    return [json.loads((observe / f"rank-{r}.json").read_text()) for r in range(nproc)]


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def kiln(*args: str, timeout: float = SAFETY_TIMEOUT_S, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], env=env(), capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, check=False)


def validation_tokens() -> np.ndarray:
    """The bytes of builtin:pydoc's validation split (its last VALIDATION_FRACTION), as a token shard."""
    tokens = np.frombuffer(pydoc_bytes(), dtype=np.uint8)
    return tokens[int(len(tokens) * (1 - VALIDATION_FRACTION)):].astype(np.uint16)


def commit_tensors(step_dir: Path, prefix: str = "model.") -> dict:
    """The tensors of a commit (its step-<n> folder) whose keys start with `prefix`, loaded whole in this process."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(step_dir))
    meta = reader.read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
               if k.startswith(prefix) and hasattr(m, "size")}
    with warnings.catch_warnings():  # no process group here: DCP says it loads in one process, which is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors
