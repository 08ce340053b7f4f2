"""External tools the tests build or install once into $KILN_CACHE_DIR/tools (the `tools` lane, CONTRIBUTING.md):
Go tools by `go install`, Python tools in a virtualenv of their own (their pins must not touch kiln's venv)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tools_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or REPO / ".cache") / "tools"


@contextmanager
def locked(name: str):
    """One builder at a time per tool, across pytest sessions."""
    tools_dir().mkdir(parents=True, exist_ok=True)
    with open(tools_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False, **kw)


def go_env() -> dict:
    return {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}


def go_installed(package: str, version: str, timeout: float = 1200, tags: str = "") -> Path:
    """`go install [-tags tags] package@version` once into $KILN_CACHE_DIR/tools/<name>-<version>/; the executable."""
    name = package.rsplit("/", 1)[-1]
    exe = tools_dir() / f"{name}-{version.lstrip('v')}" / name
    with locked(name):
        if not exe.exists():
            proc = run(["go", "install", *(["-tags", tags] if tags else []), f"{package}@{version}"],
                       env={**go_env(), "GOBIN": str(exe.parent)}, timeout=timeout)
            assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


def venv_installed(name: str, packages: list[str], timeout: float = 1200) -> Path:
    """`pip install packages` once into a virtualenv $KILN_CACHE_DIR/tools/<name>-<key>/; its bin folder."""
    key = hashlib.sha256(" ".join(packages).encode()).hexdigest()[:12]
    venv = tools_dir() / f"{name}-{key}"
    with locked(name):
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            assert run([sys.executable, "-m", "venv", venv]).returncode == 0
            proc = run([venv / "bin" / "python", "-m", "pip", "install", "-q", *packages], timeout=timeout)
            assert proc.returncode == 0, proc.stderr
            (venv / ".complete").touch()
    return venv / "bin"
