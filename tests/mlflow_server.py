"""A real MLflow tracking server for the tests (`mlflow server` from PyPI): a SQLite backend store and a
folder as its artifact store, on 127.0.0.1. Started per test session by the `mlflow_server` fixture."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.support.ranks import free_port, wait_until


@dataclass
class MlflowServer:
    uri: str
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: subprocess.Popen) -> None:
    """Terminate a server this module's callers started; kill it when it does not exit."""
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


def healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start(root: Path) -> MlflowServer:
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = root / "server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", str(root / "artifacts")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    server = MlflowServer(uri, process, log)

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"mlflow server exited {process.returncode}:\n{log.read_text()[-3000:]}")
        return healthy(uri)

    try:
        wait_until("the MLflow server's /health", ready, timeout=300)
    except BaseException:
        server.stop()
        raise
    return server
